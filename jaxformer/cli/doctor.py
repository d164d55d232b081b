"""``jaxformer doctor``: check this install on the device JAX sees (the attention kernels
compiled for it against full attention, manual gradients against jax.grad, a few
training steps per attention implementation, a short benchmark with MFU) and print one
report; the checks are ``tools.doctor.checks``, the report ``tools.doctor.report``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxformer.cli.args import nonneg_int
from jaxformer.tools.doctor import run as doctor
from jaxformer.tools.doctor.report import format_text, write_report

DESCRIPTION = ("Check this install on the device JAX sees and print one report: the Pallas attention "
               "kernels compiled for it (and cuDNN's on a GPU) against full attention in float32 and "
               "bfloat16, forward and gradients; manual gradients against jax.grad on a small "
               "GPT-2-shaped model; 20 training steps per attention implementation; a short benchmark "
               "with MFU. Exit code 0 only when no check failed (1 otherwise). On a CPU the compiled "
               "kernels do not exist: the report says so and checks interpret mode instead.")

EPILOG = """\
examples:
  jaxformer doctor                          (every check; under a minute on a 2-core CPU)
  jaxformer doctor --quick                  (tiny shapes, one bench round: about 30 s)
  jaxformer doctor --out runs/doctor.json   (the report as JSON too)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes everywhere and one bench round of one step")
    p.add_argument("--out", metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument("--seed", type=nonneg_int, default=0,
                   help="seed of the params, attention inputs and batches (default 0)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("doctor", help="check this install on this device: kernels, gradients, "
                                             "training, speed (see its --help)",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Run every check, print the report; 0 when none failed, else 1."""
    if args.out:  # a folder that cannot be made fails now, not after the checks
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report = doctor.run(doctor.Settings(quick=args.quick, seed=args.seed), say)
    print(format_text(report), flush=True)
    if args.out:
        print(f"report: {write_report(report, args.out)}")
    return 0 if report["summary"]["failed"] == 0 else 1
