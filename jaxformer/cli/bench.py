"""``jaxformer bench`` (and ``experiments/benchmark.py``): benchmark one training step,
manual vs automatic gradients vs PyTorch; the benchmark itself is ``tools.bench``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import jax

from jaxformer.cli.args import Parser, nonneg_int, positive_int, run_command
from jaxformer.cli.flags import add_model_flags, model_overrides
from jaxformer.model.config import PRESETS, get_preset
from jaxformer.tools import bench
from jaxformer.tools.bench_report import format_summary, write_reports

DESCRIPTION = ("Benchmark one training step: manual vs automatic gradients, and the same "
               "model in PyTorch when it is installed.")

EPILOG = """\
examples:
  jaxformer bench --preset loopos                       (B16 T64, writes runs/bench)
  jaxformer bench --preset loopos --d-model 512 --n-layers 6 --d-ff 2048 --max-seq-len 256 \\
      --batch-size 8 --seq-len 256 --out runs/bench-mid
  jaxformer bench --quick --out /tmp/bench              (tiny shape, one round: a smoke test)
"""


def depths(text: str) -> tuple[int, int]:
    """argparse type of --depths: two positive layer counts, "L1,L2"."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts, got {text!r}") from None
    if len(values) != 2 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected two positive layer counts like 2,24, got {text!r}")
    return tuple(values)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=list(PRESETS), help="model shape (default loopos; tiny with --quick)")
    p.add_argument("--batch-size", type=positive_int, metavar="B", help="sequences per step (default 16)")
    p.add_argument("--seq-len", type=positive_int, metavar="T",
                   help="tokens per sequence (default: the model's max_seq_len)")
    p.add_argument("--rounds", type=positive_int, metavar="N", help="interleaved timed rounds (default 7)")
    p.add_argument("--steps", type=positive_int, metavar="N", help="steps per contestant per round (default 5)")
    p.add_argument("--warmup", type=positive_int, metavar="N", help="untimed steps after compiling (default 3)")
    p.add_argument("--depths", type=depths, metavar="L1,L2",
                   help="n_layers of the compile-time-vs-depth check (default 2,24)")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch contestants")
    p.add_argument("--no-torch-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--torch-threads", type=positive_int, metavar="N",
                   help="torch.set_num_threads(N) (default: torch's own, one per core); on a "
                        "machine busy with other work, 1 avoids OpenMP threads waiting on each other")
    p.add_argument("--seed", type=nonneg_int, default=0, help="params and batch seed (default 0)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: tiny shape, one round of one step, no torch.compile")
    p.add_argument("--out", default="runs/bench", metavar="DIR",
                   help="folder for report.json, report.md, bench.png (default runs/bench)")
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


def settings_from_args(args: argparse.Namespace) -> bench.Settings:
    """The benchmark's Settings; ValueError naming the field on a bad shape."""
    quick = args.quick
    preset = args.preset or ("tiny" if quick else "loopos")
    config = get_preset(preset, **model_overrides(args))
    seq_len = args.seq_len or (8 if quick else config.max_seq_len)
    if seq_len > config.max_seq_len:
        raise ValueError(f"seq_len {seq_len} exceeds max_seq_len {config.max_seq_len} "
                         f"(pass --max-seq-len {seq_len})")

    def pick(value, normal, quick_value):
        return value if value is not None else (quick_value if quick else normal)

    return bench.Settings(
        config=config, batch_size=pick(args.batch_size, 16, 2), seq_len=seq_len,
        rounds=pick(args.rounds, 7, 1), steps=pick(args.steps, 5, 1), warmup=pick(args.warmup, 3, 1),
        depths=pick(args.depths, (2, 24), (1, 2)), torch=not args.no_torch,
        torch_compile=not (args.no_torch or args.no_torch_compile or quick),
        cpu_matmul=256 if quick else 2048, torch_threads=args.torch_threads, seed=args.seed)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark of ``args`` and write its reports."""
    s = settings_from_args(args)
    print(f"benchmarking B{s.batch_size} T{s.seq_len} L{s.config.n_layers} D{s.config.d_model} "
          f"H{s.config.n_heads} F{s.config.d_ff} on {jax.devices()[0].platform} "
          f"(load {os.getloadavg()[0]:.2f}) ...", file=sys.stderr, flush=True)
    report = bench.run(s)
    paths = write_reports(report, args.out)
    print(format_summary(report))
    print("reports: " + ", ".join(str(p) for p in paths.values()))
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "jaxformer bench") -> int:
    """Parse ``argv`` (default: sys.argv[1:]), run, write the reports; 0 on success, 2 (one
    ``error:`` line) on bad input."""
    return run_command(lambda: run(build_parser(prog).parse_args(argv)))
