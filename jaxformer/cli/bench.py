"""``jaxformer bench`` (and ``experiments/benchmark.py``): benchmark one training step,
manual vs automatic gradients over each attention implementation vs PyTorch, at one
shape or over a grid of shapes (``--shapes``); the benchmark itself is ``tools.bench.run``
(contestants chosen by ``tools.bench.select``), the sweep ``tools.bench.sweep``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import jax

from jaxformer.cli.args import Parser, nonneg_int, output_folder, positive_int, run_command
from jaxformer.cli.flags import add_model_flags, model_overrides
from jaxformer.model.config import PRESETS, get_preset
from jaxformer.tools.bench import run as bench
from jaxformer.tools.bench import sweep as bench_sweep
from jaxformer.tools.bench.report import format_summary, write_reports
from jaxformer.tools.bench.select import ATTENTION_CHOICES, parse_attention
from jaxformer.tools.bench.sweep_report import format_sweep_summary, write_sweep_reports

DESCRIPTION = ("Benchmark one training step (gradients + AdamW) on the device JAX sees: manual "
               "gradients (full, blockwise, pallas, cudnn attention), jax.grad (full, cudnn), and the same "
               "model in PyTorch (eager, torch.compile; SDPA) when it is installed.")

EPILOG = """\
examples:
  jaxformer bench --preset loopos                       (B16 T64, writes runs/bench)
  jaxformer bench --preset gpt2 --compute-dtype bfloat16 --batch-size 16 --seq-len 1024
                                                        (the GPU contest: every contestant)
  jaxformer bench --preset gpt2 --compute-dtype bfloat16 --batch-size 16 --seq-len 1024 \
      --vocab-size 50304 --attention pallas,cudnn --depths none
                                                        (GPT-2's vocabulary, padded to 64)
  jaxformer bench --preset loopos --attention full,pallas --no-torch-compile
  jaxformer bench --shapes "d_model=64,128,256,512,768 seq_len=64,256,1024" --out runs/sweep
                                                        (one row per shape; bench_sweep.png)
  jaxformer bench --quick --out /tmp/bench              (tiny shape, one round: a smoke test)
"""

# A sweep's shapes each run briefly unless --rounds / --steps / --warmup say otherwise.
SWEEP_DEFAULTS = {"rounds": 3, "steps": 2, "warmup": 1}


def depths(text: str) -> tuple[int, ...]:
    """argparse type of --depths: two positive layer counts, "L1,L2"; "none": no check (the
    empty tuple)."""
    if text == "none":
        return ()
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts, got {text!r}") from None
    if len(values) != 2 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected two positive layer counts like 2,24 (or none), got {text!r}")
    return tuple(values)


def attention_list(text: str) -> tuple[str, ...]:
    """argparse type of --attention."""
    try:
        return parse_attention(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--attention: ")) from None


def shapes(text: str) -> dict:
    """argparse type of --shapes."""
    try:
        return bench_sweep.parse_shapes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--shapes: ")) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=list(PRESETS), help="model shape (default loopos; tiny with --quick)")
    p.add_argument("--batch-size", type=positive_int, metavar="B", help="sequences per step (default 16)")
    p.add_argument("--seq-len", type=positive_int, metavar="T",
                   help="tokens per sequence (default: the model's max_seq_len)")
    p.add_argument("--rounds", type=positive_int, metavar="N", help="interleaved timed rounds (default 7)")
    p.add_argument("--steps", type=positive_int, metavar="N", help="steps per contestant per round (default 5)")
    p.add_argument("--warmup", type=positive_int, metavar="N", help="untimed steps after compiling (default 3)")
    p.add_argument("--depths", type=depths, metavar="L1,L2",
                   help="n_layers of the compile-time-vs-depth check (default 2,24; none: no check, "
                        "whose compiles of the full-attention gradients a deep model pays for)")
    p.add_argument("--vocab-size", type=positive_int, metavar="V",
                   help="vocabulary of the model and the random batch (default: the preset's; 256 "
                        "for --preset gpt2, whose real 50257 tokens nanoGPT pads to 50304)")
    p.add_argument("--attention", type=attention_list, metavar="LIST",
                   help=f"attention implementations to race, comma-separated from "
                        f"{','.join(ATTENTION_CHOICES)} (manual grads: each; "
                        f"jax.grad: full, cudnn). Default: all on a GPU; all but cudnn on a TPU; on CPU full,blockwise "
                        f"(pallas runs in slow interpret mode there, cudnn not at all)")
    p.add_argument("--shapes", type=shapes, metavar="GRID",
                   help='sweep a grid of shapes, e.g. "d_model=64,128,256 seq_len=64,256" (fields: '
                        f"{', '.join(bench_sweep.SWEEP_FIELDS)}; d_ff follows 4*d_model unless given); "
                        "one row per shape in report.md and bench_sweep.png; rounds/steps/warmup "
                        "default to {rounds}/{steps}/{warmup} per shape".format(**SWEEP_DEFAULTS))
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch contestants")
    p.add_argument("--no-torch-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--torch-threads", type=positive_int, metavar="N",
                   help="torch.set_num_threads(N) (default: torch's own, one per core); on a "
                        "machine busy with other work, 1 avoids OpenMP threads waiting on each other")
    p.add_argument("--seed", type=nonneg_int, default=0, help="params and batch seed (default 0)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: tiny shape, one round of one step, no torch.compile")
    p.add_argument("--out", default="runs/bench", metavar="DIR",
                   help="folder for report.json, report.md, bench.png (a sweep: bench_sweep.png) "
                        "(default runs/bench)")
    add_model_flags(p)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench",
                              help="benchmark a training step: manual, jax.grad, PyTorch (see its --help)",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def build_parser(prog: str = "jaxformer bench") -> argparse.ArgumentParser:
    """The command's parser on its own (``experiments/benchmark.py``)."""
    p = Parser(prog=prog, description=DESCRIPTION, epilog=EPILOG,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def attention_from_args(args: argparse.Namespace) -> tuple[str, ...] | None:
    """--attention, or the model flag --attention-impl standing for a list of one."""
    impl = getattr(args, "attention_impl", None)
    if args.attention and impl:
        raise ValueError("pass --attention (the implementations to race), not also --attention-impl")
    return args.attention or ((impl,) if impl else None)


def settings_from_args(args: argparse.Namespace) -> bench.Settings:
    """The benchmark's Settings; ValueError naming the field on a bad shape."""
    quick, sweep = args.quick, args.shapes is not None
    preset = args.preset or ("tiny" if quick else "loopos")
    overrides = {k: v for k, v in model_overrides(args).items() if k != "attention_impl"}
    if args.vocab_size:
        overrides["vocab_size"] = args.vocab_size
    config = get_preset(preset, **overrides)
    seq_len = args.seq_len or (8 if quick else config.max_seq_len)
    if seq_len > config.max_seq_len and not (sweep and "seq_len" in args.shapes):
        raise ValueError(f"seq_len {seq_len} exceeds max_seq_len {config.max_seq_len} "
                         f"(pass --max-seq-len {seq_len})")

    if args.depths is not None:
        depth_check = args.depths or None  # "none" reads as ()
    else:
        depth_check = None if sweep else (1, 2) if quick else (2, 24)

    def pick(name, normal, quick_value):
        value = getattr(args, name)
        if value is not None:
            return value
        return quick_value if quick else SWEEP_DEFAULTS[name] if sweep else normal

    return bench.Settings(
        config=config, batch_size=args.batch_size or (2 if quick else 16), seq_len=seq_len,
        rounds=pick("rounds", 7, 1), steps=pick("steps", 5, 1), warmup=pick("warmup", 3, 1),
        depths=depth_check, torch=not args.no_torch,
        torch_compile=not (args.no_torch or args.no_torch_compile or quick),
        cpu_matmul=256 if quick else 2048, torch_threads=args.torch_threads, seed=args.seed,
        attention=attention_from_args(args),
        torch_compile_off="--quick" if quick and not args.no_torch_compile else "--no-torch-compile")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark (or the sweep) of ``args`` and write its reports."""
    # JAX takes 75% of a GPU's memory at start-up unless told otherwise: on demand instead,
    # so that PyTorch's contestants share the device (set before JAX's backend starts).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    s = settings_from_args(args)
    output_folder(args.out, "--out")
    for point in bench_sweep.grid(args.shapes or {}) if args.shapes else ():
        bench_sweep.point_settings(s, point)  # every shape checked (ValueError) before any runs
    dev = jax.devices()[0]
    what = (f"{len(bench_sweep.grid(args.shapes))} shapes of {args.shapes}" if args.shapes
            else f"B{s.batch_size} T{s.seq_len} L{s.config.n_layers} D{s.config.d_model} "
                 f"H{s.config.n_heads} F{s.config.d_ff}")
    say(f"benchmarking {what} on {dev.platform} ({getattr(dev, 'device_kind', '')}), compute "
        f"{s.config.compute_dtype or 'float32'} (load {os.getloadavg()[0]:.2f}) ...")
    if args.shapes is not None:
        sweep = bench_sweep.run_sweep(s, args.shapes, say)
        paths = write_sweep_reports(sweep, args.out)
        print(format_sweep_summary(sweep))
    else:
        report = bench.run(s, say)
        paths = write_reports(report, args.out)
        print(format_summary(report))
    print("reports: " + ", ".join(str(p) for p in paths.values()))
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "jaxformer bench") -> int:
    """Parse ``argv`` (default: sys.argv[1:]), run, write the reports; 0 on success, 2 (one
    ``error:`` line) on bad input."""
    return run_command(lambda: run(build_parser(prog).parse_args(argv)))
