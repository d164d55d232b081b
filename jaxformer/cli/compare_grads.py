"""``jaxformer compare-grads`` (and ``experiments/compare_grads.py``, the main job): the
hand-derived gradients against jax.grad, leaf by leaf, for each preset, with reports.
The comparison itself is ``tools.compare.grads``; the reports ``tools.compare.report``.

Every ModelConfig field has a flag (``cli.flags``: ``--compute-dtype``,
``--attention-impl``, ``--loss-chunk``, ...), applied to the config of each preset.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

import jax

from jaxformer.cli import flags
from jaxformer.cli.args import Parser, UsageError, nonneg_int, output_folder, positive_int, run_command
from jaxformer.model.config import PRESETS
from jaxformer.model.validate import check_precision
from jaxformer.tools.compare.grads import DEFAULT_PRESETS, GradFn, compare_imported, compare_preset
from jaxformer.tools.compare.fd import FD_DIRECTIONS, FD_TOLERANCE
from jaxformer.tools.compare.report import build_report, format_preset, status, use_color, write_reports

REPORT_FILES = ("report.json", "report.md", "rel_errors.png")
# The options recorded in report.json, besides the model flags given.
OPTIONS = ("preset", "dtype", "fd", "fd_directions", "batch_size", "seq_len", "seed", "repeats", "out")
DESCRIPTION = ("Compare the hand-derived gradients (manual_grads) with jax.grad, leaf by leaf, "
               "for each preset; write JSON, Markdown and PNG reports. Exits 1 naming the leaf "
               "when any gradient is over tolerance.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", nargs="+", action="extend", choices=sorted(PRESETS),
                        metavar="NAME", help=f"one or more of {', '.join(PRESETS)} "
                        f"(default: {' '.join(DEFAULT_PRESETS)})")
    parser.add_argument("--init-from", metavar="DIR_OR_HUB_ID",
                        help="compare on a Hugging Face GPT-2's or Llama's real weights and config "
                             "instead of the presets")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                        help="dtype of params and gradients (float64 turns on jax_enable_x64); "
                             "default float32")
    parser.add_argument("--fd", action="store_true",
                        help="also check the manual gradient of every leaf against float64 "
                             f"finite differences (relative tolerance {FD_TOLERANCE:.0e})")
    parser.add_argument("--fd-directions", metavar="N", type=positive_int, default=FD_DIRECTIONS,
                        help=f"random directions per leaf for --fd (default {FD_DIRECTIONS})")
    parser.add_argument("--batch-size", metavar="B", type=positive_int, default=4,
                        help="sequences per batch (default 4)")
    parser.add_argument("--seq-len", metavar="T", type=positive_int, default=32,
                        help="tokens per sequence, cut to the preset's max_seq_len (default 32)")
    parser.add_argument("--seed", metavar="N", type=nonneg_int, default=0,
                        help="params and batch seed (default 0)")
    parser.add_argument("--repeats", metavar="N", type=positive_int, default=10,
                        help="timed calls of each jitted gradient (default 10)")
    parser.add_argument("--out", metavar="DIR", default="runs/compare_grads",
                        help="folder for report.json, report.md, rel_errors.png "
                             "(default runs/compare_grads; files there are replaced)")
    flags.add_model_flags(parser, "model (applied to every preset; --compute-dtype bfloat16 "
                          "judges both sources against a reference without it)")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("compare-grads", help="compare manual gradients with jax.grad (see its --help)",
                              description=DESCRIPTION)
    add_arguments(p)
    return p


def build_parser(prog: str = "jaxformer compare-grads") -> argparse.ArgumentParser:
    """The command's parser on its own (``experiments/compare_grads.py``)."""
    parser = Parser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    return parser


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Complete parsed ``args``: the presets once each, in order (default DEFAULT_PRESETS),
    and ``args.overrides`` = the model flags given, checked against every preset
    (UsageError naming the preset and the field)."""
    args.preset = list(dict.fromkeys(args.preset or DEFAULT_PRESETS))
    args.overrides = flags.model_overrides(args)
    for name in args.preset:
        try:
            check_precision({}, PRESETS[name].replace(**args.overrides))
        except ValueError as err:
            raise UsageError(f"preset {name}: {err}") from None
    return args


def parse_args(argv: Sequence[str] | None = None,
               prog: str = "jaxformer compare-grads") -> argparse.Namespace:
    """The resolved options of ``argv``; UsageError on bad input."""
    return resolve(build_parser(prog).parse_args(argv))


def announce_replaced(out: str | os.PathLike) -> None:
    """One line when ``out`` already holds report files that this run replaces."""
    found = [f for f in REPORT_FILES if (Path(out) / f).exists()]
    if found:
        print(f"replacing the existing report files in {out}: {', '.join(found)}")


def run(args: argparse.Namespace, manual_fn: GradFn | None = None) -> int:
    """Run the comparison of parsed ``args``; 0 when every leaf of every preset passes, 1
    otherwise (naming the leaf on stderr)."""
    args = resolve(args)
    output_folder(args.out, "--out")
    if args.dtype == "float64" or args.fd:
        jax.config.update("jax_enable_x64", True)  # before anything is traced
    color = use_color(sys.stdout)
    reports = []
    if args.init_from:
        r = compare_imported(args.init_from, dtype=args.dtype, batch_size=args.batch_size,
                             seq_len=args.seq_len, seed=args.seed, repeats=args.repeats,
                             fd=args.fd, fd_directions=args.fd_directions, manual_fn=manual_fn,
                             overrides=args.overrides,
                             check=lambda c: flags.refuse_weight_changes(args.init_from, args.overrides, c))
        print(format_preset(r, color), flush=True)
        reports.append(r)
    for name in ([] if args.init_from else args.preset):
        if sys.stderr.isatty():
            print(f"{name}: compiling and timing both gradients ({args.dtype}) ...",
                  file=sys.stderr, flush=True)
        r = compare_preset(name, dtype=args.dtype, batch_size=args.batch_size,
                           seq_len=args.seq_len, seed=args.seed, repeats=args.repeats,
                           fd=args.fd, fd_directions=args.fd_directions, manual_fn=manual_fn,
                           overrides=args.overrides)
        print(format_preset(r, color), flush=True)
        reports.append(r)
    options = {k: getattr(args, k) for k in OPTIONS}
    options.update(args.overrides)
    report = build_report(reports, options)
    announce_replaced(args.out)
    paths = write_reports(report, args.out)
    print("=" * 96)
    for r in reports:
        print(f"  {r.preset:<10} {status(r.passed, color)}")
    print(f"overall: {status(report['passed'], color)}   reports: "
          + ", ".join(str(p) for p in paths.values()))
    if not report["passed"]:
        for r in reports:
            for f in r.failures:
                print(f"FAIL {r.preset}: {f}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None, manual_fn: GradFn | None = None,
         prog: str = "jaxformer compare-grads") -> int:
    """Parse ``argv`` (default: sys.argv[1:]) and run; 0 when every leaf passes, 1 when one
    does not, 2 (one ``error:`` line) on bad input. ``manual_fn`` replaces the manual
    gradient source (a deliberately broken one shows that the job fails)."""
    return run_command(lambda: run(build_parser(prog).parse_args(argv), manual_fn))
