"""Blockwise and Pallas attention's work falls with a sliding window (a benchmark, not a test).

The blockwise core (jaxformer/model/blockwise.py) walks, for each query block, only the key
blocks a window of W keys reaches (ceil((W - 1) / K) + 1 of them), forward and the manual
backward (manual_grads/blockwise.py) alike, so a step costs O(T W), not O(T^2). This times
one forward + manual backward of the core, float32, causal, at one length T and block K, for
no window and for several W, in interleaved rounds after a warm-up call, and prints each
median time as a ratio of the no-window one (one run's measurement). ``--impl pallas``
times the Pallas kernels instead (jaxformer/kernels/pallas: the forward's and both backward
kernels' loops start and stop at the window), interpreted off a GPU or TPU: the time is the
kernels' work (the blocks they visit), not their speed on a device.

    python experiments/sliding_window.py
    python experiments/sliding_window.py --impl pallas --seq 1024
    python experiments/sliding_window.py --seq 4096 --block 128 --windows 2048 512 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from jaxformer.kernels.pallas import flash_core_bwd, flash_core_fwd
from jaxformer.model.cores import AttentionSpec
from manual_grads.blockwise import blockwise_core_bwd, blockwise_core_fwd


def step_fn(spec: AttentionSpec, impl: str = "blockwise"):
    """(q, k, v, dout) -> (dq, dk, dv): the core's forward and its backward (blockwise: the
    manual one; pallas: the backward kernels), jitted."""
    def step(q, k, v, dout):
        if impl == "pallas":
            _, res = flash_core_fwd(q, k, v, True, spec.block, spec.block, window=spec.window)
            return flash_core_bwd(res, dout)
        _, res = blockwise_core_fwd(q, k, v, spec)
        return blockwise_core_bwd(res, dout)
    return jax.jit(step)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--windows", type=int, nargs="+", default=[1024, 256, 128])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--impl", choices=("blockwise", "pallas"), default="blockwise")
    a = p.parse_args(argv)
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, do = (jax.random.normal(key, (a.batch, a.heads, a.seq, a.head_dim)) for key in keys)
    windows = [0, *a.windows]
    fns = {w: step_fn(AttentionSpec(block=a.block, window=w), a.impl) for w in windows}
    for f in fns.values():
        jax.block_until_ready(f(q, k, v, do))  # compile and warm up
    times = {w: [] for w in windows}
    for _ in range(a.rounds):
        for w, f in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(f(q, k, v, do))
            times[w].append(time.perf_counter() - start)
    base = statistics.median(times[0])
    what = "Pallas forward + backward kernels" if a.impl == "pallas" else "blockwise forward + manual backward"
    print(f"{what}, B{a.batch} H{a.heads} T{a.seq} Dh{a.head_dim} K{a.block}, "
          f"float32, {jax.devices()[0].platform}; median of {a.rounds} rounds")
    print("| window | key blocks per query block | time | time / no window |")
    print("|---|---|---|---|")
    for w in windows:
        n = -(-a.seq // a.block) if not w else min(-(-a.seq // a.block), -(-(w - 1) // a.block) + 1)
        t = statistics.median(times[w])
        print(f"| {w or 'none'} | {n} | {1e3 * t:.1f} ms | {t / base:.2f} |")


if __name__ == "__main__":
    main()
