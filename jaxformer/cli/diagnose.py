"""``jaxformer diagnose``: per-layer activation ranges and gradient norms of a checkpoint."""

from __future__ import annotations

import argparse

import jax

from jaxformer.checkpoints import checkpoint
from jaxformer.cli.args import nonneg_int
from jaxformer.training.diagnose import diagnose_run

EPILOG = """\
Runs the checkpoint's next training batch eagerly through the hand-derived forward and
backward, layer by layer, and prints each stage's activation range and gradient norm,
and the first stage whose output or gradient is NaN or infinite.

examples:
  jaxformer diagnose --run runs/loopos
  jaxformer diagnose --run runs/loopos --step 200
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    d = subparsers.add_parser("diagnose",
                              help="per-layer activation ranges and gradient norms of a checkpoint",
                              description="Find the layer that makes a NaN or an infinity.",
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("--run", required=True, metavar="DIR", help="run folder written by `jaxformer train`")
    d.add_argument("--step", type=nonneg_int, metavar="N",
                   help="the checkpoint of step N (default: the newest that verifies)")
    return d


def run(args: argparse.Namespace) -> int:
    meta = checkpoint.read_meta(args.run, args.step) if args.step is not None \
        else checkpoint.newest_meta(args.run)
    if meta.get("param_dtype") == "float64":
        jax.config.update("jax_enable_x64", True)
    print(diagnose_run(args.run, args.step))
    return 0
