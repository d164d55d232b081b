"""The command line of the gradient comparison: ``jaxformer compare-grads`` and
``experiments/compare_grads.py`` (both call ``main``; ``jaxformer.compare.main`` too).

Every ModelConfig field has a flag (``jaxformer.flags``: ``--compute-dtype``,
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
from jaxformer.tools.compare import (DEFAULT_PRESETS, FD_DIRECTIONS, FD_TOLERANCE, GradFn,
                                     compare_preset)
from jaxformer.tools.compare_report import (_status, _use_color, build_report, format_preset,
                                            write_reports)
from jaxformer.model.config import PRESETS
from jaxformer.model.validate import check_precision

REPORT_FILES = ("report.json", "report.md", "rel_errors.png")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "compare_grads.py"
    parser = argparse.ArgumentParser(
        prog="jaxformer compare-grads" if prog == "jaxformer" else prog,
        description="Compare the hand-derived gradients (manual_grads) with jax.grad, leaf by "
                    "leaf, for each preset; write JSON, Markdown and PNG reports. Exits 1 "
                    "naming the leaf when any gradient is over tolerance.")
    parser.add_argument("--preset", nargs="+", action="extend", choices=sorted(PRESETS),
                        metavar="NAME", help=f"one or more of {', '.join(PRESETS)} "
                        f"(default: {' '.join(DEFAULT_PRESETS)})")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                        help="dtype of params and gradients (float64 turns on jax_enable_x64); "
                             "default float32")
    parser.add_argument("--fd", action="store_true",
                        help="also check the manual gradient of every leaf against float64 "
                             f"finite differences (relative tolerance {FD_TOLERANCE:.0e})")
    parser.add_argument("--fd-directions", metavar="N", type=int, default=FD_DIRECTIONS,
                        help=f"random directions per leaf for --fd (default {FD_DIRECTIONS})")
    parser.add_argument("--batch-size", metavar="B", type=int, default=4,
                        help="sequences per batch (default 4)")
    parser.add_argument("--seq-len", metavar="T", type=int, default=32,
                        help="tokens per sequence, cut to the preset's max_seq_len (default 32)")
    parser.add_argument("--seed", metavar="N", type=int, default=0,
                        help="params and batch seed (default 0)")
    parser.add_argument("--repeats", metavar="N", type=int, default=10,
                        help="timed calls of each jitted gradient (default 10)")
    parser.add_argument("--out", metavar="DIR", default="runs/compare_grads",
                        help="folder for report.json, report.md, rel_errors.png "
                             "(default runs/compare_grads; files there are replaced)")
    flags.add_model_flags(parser, "model (applied to every preset; --compute-dtype bfloat16 "
                          "judges both sources against a reference without it)")
    args = parser.parse_args(argv)
    for name in ("batch_size", "seq_len", "repeats", "fd_directions"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    args.preset = list(dict.fromkeys(args.preset or DEFAULT_PRESETS))
    args.overrides = flags.model_overrides(args)
    for name in args.preset:
        try:
            check_precision({}, PRESETS[name].replace(**args.overrides))
        except ValueError as err:
            parser.error(f"preset {name}: {err}")
    return args


def announce_replaced(out: str | os.PathLike) -> None:
    """One line when ``out`` already holds report files that this run replaces."""
    found = [f for f in REPORT_FILES if (Path(out) / f).exists()]
    if found:
        print(f"replacing the existing report files in {out}: {', '.join(found)}")


def main(argv: Sequence[str] | None = None, manual_fn: GradFn | None = None) -> int:
    """Run the comparison; 0 when every leaf of every preset passes, 1 otherwise."""
    args = parse_args(argv)
    if args.dtype == "float64" or args.fd:
        jax.config.update("jax_enable_x64", True)  # before anything is traced
    color = _use_color(sys.stdout)
    reports = []
    for name in args.preset:
        if sys.stderr.isatty():
            print(f"{name}: compiling and timing both gradients ({args.dtype}) ...",
                  file=sys.stderr, flush=True)
        r = compare_preset(name, dtype=args.dtype, batch_size=args.batch_size,
                           seq_len=args.seq_len, seed=args.seed, repeats=args.repeats,
                           fd=args.fd, fd_directions=args.fd_directions, manual_fn=manual_fn,
                           overrides=args.overrides)
        print(format_preset(r, color), flush=True)
        reports.append(r)
    model_fields = {f.name for f in flags.model_fields()}
    options = {k: v for k, v in vars(args).items() if k not in model_fields and k != "overrides"}
    options.update(args.overrides)
    report = build_report(reports, options)
    announce_replaced(args.out)
    paths = write_reports(report, args.out)
    print("=" * 96)
    for r in reports:
        print(f"  {r.preset:<10} {_status(r.passed, color)}")
    print(f"overall: {_status(report['passed'], color)}   reports: "
          + ", ".join(str(p) for p in paths.values()))
    if not report["passed"]:
        for r in reports:
            for f in r.failures:
                print(f"FAIL {r.preset}: {f}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
