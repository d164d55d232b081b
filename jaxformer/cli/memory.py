"""The command line of ``experiments/memory.py``: the lean manual backward's memory and
step time against the plain ones (the figures are ``tools.memory``'s)."""

from __future__ import annotations

import argparse
from typing import Sequence

from jaxformer.cli.args import Parser, positive_int, run_command
from jaxformer.tools import memory

DESCRIPTION = ("Memory of the lean manual backward (blockwise attention, chunked loss, block "
               "recompute), and of the Pallas flash-attention kernel's")


def sources(text: str) -> tuple[str, ...]:
    """argparse type of --sources."""
    try:
        return memory.parse_sources(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser(prog: str = "memory.py") -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description=DESCRIPTION)
    parser.add_argument("--batch-size", type=positive_int, default=4)
    parser.add_argument("--seq-len", type=positive_int, default=1024, help="T; (b) also compiles at 2T")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--attention-block", type=int, default=128, help="query and key block size")
    parser.add_argument("--loss-chunk", type=positive_int, default=256, help="positions per chunk of the loss")
    parser.add_argument("--rounds", type=positive_int, default=5, help="timed rounds (after one warm-up)")
    parser.add_argument("--no-timing", dest="timing", action="store_false", help="memory only")
    parser.add_argument("--sources", type=sources, metavar="LIST",
                        help=f"gradient sources, comma-separated from {','.join(memory.ALL_SOURCES)} "
                             f"(default: {','.join(memory.SOURCES)}, and pallas on a GPU or TPU; on CPU the "
                             f"Pallas kernel runs in slow interpret mode: opt in with "
                             f"--sources {','.join(memory.ALL_SOURCES)})")
    return parser


def run(args: argparse.Namespace) -> int:
    config = memory.memory_config(args.seq_len, args.d_model, args.n_heads, args.n_layers,
                                  args.vocab_size, args.attention_block)  # ValueError naming a field
    if args.sources is None and "pallas" not in memory.default_sources():
        print("pallas: left out on this backend by default (interpret mode, slow): "
              "opt in with --sources " + ",".join(memory.ALL_SOURCES))
    print(f"B={args.batch_size} D={args.d_model} H={args.n_heads} L={args.n_layers} "
          f"V={args.vocab_size}, float32; blockwise block {args.attention_block}, "
          f"loss chunk {args.loss_chunk}")
    report = memory.memory_report(config, args.batch_size, args.seq_len, 2 * args.seq_len,
                                  args.loss_chunk, rounds=args.rounds, timing=args.timing,
                                  sources=args.sources)
    print(memory.format_report(report, args.seq_len, 2 * args.seq_len))
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "memory.py") -> int:
    """Parse ``argv`` (default: sys.argv[1:]) and print the figures; 2 (one ``error:``
    line) on bad input."""
    return run_command(lambda: run(build_parser(prog).parse_args(argv)))
