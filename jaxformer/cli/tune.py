"""``jaxformer tune``: tune the Pallas kernels' launch on this GPU for a model's
attention shape and write it to the launch table (``~/.cache/jaxformer/pallas_launches.json``,
``$XDG_CACHE_HOME``), which every later trace of that shape on this GPU kind reads.

Tuning is this explicit act (and ``jaxformer bench``'s, before it times the pallas step):
a traced model only reads the table, and an untuned shape takes the default tiling.
"""

from __future__ import annotations

import argparse

from jaxformer.cli.args import positive_int
from jaxformer.cli.flags import add_model_flags, model_overrides
from jaxformer.kernels.pallas import timing as pallas_timing
from jaxformer.kernels.pallas import tune as pallas_tune
from jaxformer.model.config import PRESETS, get_preset
from jaxformer.tools.bench.run import pallas_shape

DESCRIPTION = ("Time the Pallas attention kernels' candidate launches (block sizes, Triton's warps "
               "and stages) on this GPU at a model's attention shape and write the fastest to the "
               "launch table, which training, generation and the benchmark then read (a traced model "
               "never times anything: an untuned shape takes the default tiling). Needs a GPU.")

EPILOG = """\
examples:
  jaxformer tune --preset gpt2 --compute-dtype bfloat16 --seq-len 1024
  jaxformer tune --preset loopos --again        (time again, replacing the stored launch)
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("tune", help="tune the Pallas kernels' launch on this GPU (see its --help)",
                              description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=list(PRESETS), default="gpt2", help="model shape (default gpt2)")
    p.add_argument("--seq-len", type=positive_int, metavar="T",
                   help="tokens per sequence (default: the model's max_seq_len)")
    p.add_argument("--again", action="store_true", help="time the shape even when the table has it")
    add_model_flags(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Tune the shape of ``args`` (ValueError off a GPU: one error line, exit 2)."""
    config = get_preset(args.preset, **model_overrides(args))
    shape = pallas_shape(config, args.seq_len or config.max_seq_len)
    picked = pallas_timing.tune([shape], again=args.again)[shape]
    print(f"{pallas_tune.key(pallas_tune.device_kind(), shape)}: block_q {picked.block_q}, block_k "
          f"{picked.block_k}, num_warps {picked.num_warps}, num_stages {picked.num_stages} "
          f"({pallas_tune.cache_path()})")
    return 0
