"""The rate of each kind of matrix product a train step runs, XLA against PyTorch on
the same CPU (a benchmark, not a test; needs the bench extra's torch).

A step at the mid shape (L6 D512 F2048, B8 T256) runs 2-D products over B*T rows (the
forward's x @ w, the backward's dy @ w^T and x^T @ dy) and batched (B, H, T, Dh)
attention products (q @ k^T, p @ v). Each is timed here alone, float32, both
libraries on every core, in interleaved rounds after a warm-up call; the medians are
printed as GFLOP/s with the ratio PyTorch / XLA.

    python experiments/product_rates.py
    python experiments/product_rates.py --batch 16 --seq 64 --d-model 128 --heads 8  # loopos
"""

from __future__ import annotations

import argparse
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.tools.compare.grads import time_calls


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--rounds", type=int, default=15)
    a = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        raise SystemExit("error: needs PyTorch (pip install torch --index-url "
                         "https://download.pytorch.org/whl/cpu)") from None
    B, T, D, H = a.batch, a.seq, a.d_model, a.heads
    N, F, Dh = B * T, 4 * a.d_model, D // H
    rng = np.random.default_rng(0)
    x, dy, w = (rng.standard_normal(s, dtype=np.float32) for s in ((N, D), (N, F), (D, F)))
    q, pr = (rng.standard_normal(s, dtype=np.float32) for s in ((B, H, T, Dh), (B, H, T, T)))
    jx, jdy, jw, jq, jp = map(jnp.asarray, (x, dy, w, q, pr))
    tx, tdy, tw, tq, tp = map(torch.from_numpy, (x, dy, w, q, pr))
    dense, attn = 2 * N * D * F, 2 * B * H * T * T * Dh
    cases = [  # name, flops, jitted XLA function and its arguments, the PyTorch call
        ("x @ w        (N,D)(D,F)", dense, jax.jit(lambda u, v: u @ v), (jx, jw), lambda: tx @ tw),
        ("dy @ w^T     (N,F)(F,D)", dense, jax.jit(lambda u, v: u @ v.T), (jdy, jw), lambda: tdy @ tw.T),
        ("x^T @ dy     (D,N)(N,F)", dense, jax.jit(lambda u, v: u.T @ v), (jx, jdy), lambda: tx.T @ tdy),
        ("q @ k^T      (B,H,T,Dh)", attn, jax.jit(lambda u: jnp.einsum("bhqd,bhkd->bhqk", u, u)), (jq,),
         lambda: tq @ tq.transpose(-1, -2)),
        ("p @ v        (B,H,T,T)", attn, jax.jit(lambda u, v: jnp.einsum("bhqk,bhkd->bhqd", u, v)),
         (jp, jq), lambda: tp @ tq),
    ]
    print(f"N = B*T = {N}, D {D}, F {F}, H {H}, Dh {Dh}; float32; torch threads "
          f"{torch.get_num_threads()}; load {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'product':24s} {'XLA GFLOP/s':>12s} {'PyTorch':>9s} {'PyTorch / XLA':>14s}")
    for name, flops, fn, args, tfn in cases:
        fn(*args).block_until_ready(), tfn()  # warm-up (compile)
        tj, tt = map(statistics.median, time_calls([lambda: fn(*args), tfn], (), a.rounds))
        print(f"{name:24s} {flops / tj / 1e9:12.0f} {flops / tt / 1e9:9.0f} {tj / tt:14.2f}")
    print(f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
