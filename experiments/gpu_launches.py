"""The manual bf16 train step (the Pallas kernels' attention, or cuDNN's) compiled for an H100 without one (JAX's CUDA plugin,
deviceless; ``python -m jaxformer.tools.aot.plugin`` installs it): kernels launched per step
and the bytes they read and write (jaxformer/tools/aot/launches.py), XLA's temporaries and
the compile time, with the layers as
a GPU program runs them (unrolled) and as a scan (manual_grads.remat.GPU_UNROLL False), and
with the norms as the Pallas kernels (manual_grads.norms, the default) or as XLA's fusions
(``--norms xla``): the figures of docs/benchmark.md, "Kernels per step".

    PYTHONPATH=.venv/cuda-plugin python experiments/gpu_launches.py
    PYTHONPATH=.venv/cuda-plugin python experiments/gpu_launches.py --shapes gpt2:16:1024 --n-layers 12,30
    PYTHONPATH=.venv/cuda-plugin python experiments/gpu_launches.py --attention pallas,cudnn --layers unrolled
    PYTHONPATH=.venv/cuda-plugin python experiments/gpu_launches.py --norms kernels,xla --layers unrolled
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin only compiles here

import argparse  # noqa: E402

from jaxformer.model.config import get_preset  # noqa: E402
from jaxformer.tools.aot import steps as aot  # noqa: E402
from jaxformer.tools.aot.targets import TARGETS, missing  # noqa: E402
from jaxformer.training.optim import make_optimizer  # noqa: E402
from jaxformer.training.settings import settings_for  # noqa: E402
from manual_grads import norms, remat  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_launches.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="gpt2:16:1024,smollm:8:2048", help="PRESET:BATCH:SEQ_LEN,...")
    parser.add_argument("--n-layers", default="", help="depths to compile each shape at (default: the preset's)")
    parser.add_argument("--vocab-size", type=int, default=0, help="default: the preset's")
    parser.add_argument("--layers", default="unrolled,scan", help="unrolled, scan or both")
    parser.add_argument("--attention", default="pallas", help="pallas, cudnn or both (cuDNN: the library too)")
    parser.add_argument("--norms", default="kernels", help="kernels (the Pallas kernels), xla or both")
    args = parser.parse_args(argv)
    if missing(TARGETS["h100"]):
        parser.error(missing(TARGETS["h100"]))
    optimizer = make_optimizer(**settings_for("gpt2").optimizer_kwargs())
    print("| shape | layers | attention | norms | kernels per step | GiB read + written | temp MiB | compile s |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        preset, batch, seq_len = shape.split(":")
        base = get_preset(preset, **({"vocab_size": args.vocab_size} if args.vocab_size else {}))
        for depth in [int(n) for n in args.n_layers.split(",") if n] or [base.n_layers]:
            config = base.replace(n_layers=depth)
            for how in args.layers.split(","):
                remat.GPU_UNROLL = how == "unrolled"
                for attention in args.attention.split(","):
                    for kind in args.norms.split(","):
                        norms.GPU_KERNELS = kind == "kernels"
                        o = aot.compile_for(config, aot.Variant(attention, "manual", "bfloat16"), "h100", optimizer,
                                            int(batch), int(seq_len))
                        row = f"| {preset} L{depth} B{batch} T{seq_len} V{config.vocab_size} | {how} | {attention} | {kind} |"
                        if o.stage != "compiled":
                            print(f"{row} {o.stage}: {o.reason} |", flush=True)
                            continue
                        print(f"{row} {o.launches:,} | {o.traffic / 2**30:.1f} | {o.memory.temp / 2**20:,.0f} | "
                              f"{o.seconds:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
