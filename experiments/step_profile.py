"""Where one training step's device time goes: the bench's contestants (same model, batch and
AdamW as `jaxformer bench`), each traced over a few steps, their kernels summed by name.

    python experiments/step_profile.py --preset gpt2 --compute-dtype bfloat16 --batch-size 16 \
        --seq-len 1024 --contestants manual_pallas,auto_cudnn,torch_eager

For a JAX contestant the trace is ``jax.profiler.trace`` read back with ``jax.profiler.ProfileData``:
each line of the device plane with its event count and busy time per step (the stream lines hold
the kernels), then the slowest kernels of the busiest stream line. For PyTorch it is
``torch.profiler`` (device time per kernel). Wall ms/step is measured on the same steps, so
busy / wall says how much of the step the device sat idle (launches, host work, gaps).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import tempfile
import time

import jax
import jax.numpy as jnp

from jaxformer import get_preset, init_params
from jaxformer.tools.bench.contestants import make_contestants
from jaxformer.tools.bench.select import TORCH_KINDS, Spec, torch_device
from jaxformer.data.batching import random_batch
from manual_grads import norms, remat


def kernel_family(name: str) -> str:
    """A coarse class of a kernel name: matmul, attention kernel, fusion, copy, other."""
    n = name.lower()
    for key, fam in (("gemm", "matmul"), ("nvjet", "matmul"), ("cutlass", "matmul"), ("cublas", "matmul"),
                     ("flash", "attention"), ("fmha", "attention"), ("cudnn", "attention"),
                     ("pallas", "attention"), ("triton", "triton"), ("memcpy", "copy"), ("memset", "copy"),
                     ("copy", "copy"), ("fusion", "fusion"), ("reduce", "fusion"), ("loop", "fusion")):
        if key in n:
            return fam
    return "other"


def report(title: str, kernels: dict[str, list[float]], steps: int, wall_ms: float, top: int) -> None:
    """Print per-family and per-kernel busy ms per step (kernels: name -> durations in ms)."""
    busy = sum(sum(d) for d in kernels.values()) / steps
    print(f"\n== {title}: wall {wall_ms:.2f} ms/step, device busy {busy:.2f} ms/step "
          f"({100 * busy / wall_ms:.0f}%)")
    fam = collections.Counter()
    for name, d in kernels.items():
        fam[kernel_family(name)] += sum(d) / steps
    print("  " + ", ".join(f"{k} {v:.2f} ms" for k, v in fam.most_common()))
    rows = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    for name, d in rows:
        print(f"  {sum(d) / steps:8.3f} ms  {len(d) / steps:6.1f}x  {kernel_family(name):9s}  {name[:110]}")


def wall_ms(c, steps: int) -> float:
    """ms per step of ``c`` over ``steps`` steps, after 3 untimed ones."""
    c.run(3)
    t0 = time.perf_counter()
    c.run(steps)
    return 1e3 * (time.perf_counter() - t0) / steps


def by_name(events) -> dict[str, list[float]]:
    """(name, ms) pairs -> name -> [ms, ...]."""
    out = collections.defaultdict(list)
    for name, ms in events:
        out[name].append(ms)
    return out


def jax_profile(c, steps: int, top: int) -> None:
    wall = wall_ms(c, steps)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            c.run(steps)
        path = max(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
        data = jax.profiler.ProfileData.from_file(path)
    planes = [p for p in data.planes if p.name.startswith(("/device:GPU", "/device:TPU"))]
    if not planes:
        print(f"\n{c.name}: wall {wall:.2f} ms/step; the trace has no GPU or TPU plane, so no kernel times")
        return
    lines = {line.name: [(e.name, e.duration_ns / 1e6) for e in line.events] for line in planes[0].lines}
    print(f"\n{c.name}: plane {planes[0].name}")
    for name, ev in lines.items():
        print(f"  line {name[:60]!r}: {len(ev) / steps:.1f} events/step, "
              f"{sum(t for _, t in ev) / steps:.2f} ms/step")
    streams = [n for n, ev in lines.items() if "stream" in n.lower() and ev] or [n for n, ev in lines.items() if ev]
    busiest = max(streams, key=lambda n: sum(t for _, t in lines[n]))
    report(f"{c.name} ({busiest})", by_name(lines[busiest]), steps, wall, top)
    if lines.get("XLA Ops"):
        report(f"{c.name} (XLA Ops)", by_name(lines["XLA Ops"]), steps, wall, top)


def torch_profile(c, steps: int, top: int) -> None:
    import torch

    if not torch.cuda.is_available():
        print(f"\n{c.name}: torch sees no CUDA device, so no kernel times")
        return
    from torch.profiler import ProfilerActivity, profile

    wall = wall_ms(c, steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        c.run(steps)  # blocks at the end
    report(c.name, by_name((e.name, e.device_time / 1e3) for e in prof.events()
                           if e.device_type == torch.autograd.DeviceType.CUDA), steps, wall, top)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--compute-dtype", default="bfloat16")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--n-layers", type=int, default=None)
    p.add_argument("--contestants", default="manual_pallas,auto_cudnn,torch_eager")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--unroll-max-layers", type=int, default=None,
                   help="manual_grads.remat.UNROLL_MAX_LAYERS for this run: models of at most this many "
                        "layers run their blocks as a Python loop rather than a lax.scan")
    p.add_argument("--norms", choices=("kernels", "xla"), default="kernels",
                   help="the manual step's norms on a GPU: the Pallas kernels (manual_grads.norms, the "
                        "default) or XLA's fusions")
    a = p.parse_args()
    norms.GPU_KERNELS = a.norms == "kernels"
    if a.unroll_max_layers is not None:
        remat.UNROLL_MAX_LAYERS = a.unroll_max_layers
    overrides = {"compute_dtype": a.compute_dtype, "max_seq_len": a.seq_len}
    if a.n_layers:
        overrides["n_layers"] = a.n_layers
    config = get_preset(a.preset, **overrides)
    params = init_params(jax.random.PRNGKey(0), config, dtype=jnp.float32)
    batch = random_batch(config, a.batch_size, a.seq_len, 0)
    print(f"{a.preset} B{a.batch_size} T{a.seq_len} {a.compute_dtype} on {jax.devices()[0].device_kind}")
    specs = [Spec(name, "torch", "sdpa") if name in TORCH_KINDS else Spec(name, *name.split("_", 1))
             for name in a.contestants.split(",")]
    device, why = torch_device(jax.devices()[0].platform)
    if why and any(spec.grads == "torch" for spec in specs):
        print(f"PyTorch contestants: {why}")
        specs = [spec for spec in specs if spec.grads != "torch"]
    for c in make_contestants(specs, config, params, batch, torch_device=device):
        if c.error:
            print(f"{c.name}: {c.error}")
        else:
            (torch_profile if c.spec.grads == "torch" else jax_profile)(c, a.steps, a.top)

if __name__ == "__main__":
    main()
