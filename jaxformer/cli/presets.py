"""``jaxformer presets``: the presets' shapes, parameter counts and training recipes."""

from __future__ import annotations

import argparse

from jaxformer.observe.report import presets_table


def add_parser(subparsers) -> argparse.ArgumentParser:
    return subparsers.add_parser("presets", help="list the presets: shape, parameter count, training recipe",
                                 description="The presets: model shape, parameter count for the byte "
                                             "tokenizer (vocab 256) and training recipe.")


def run(args: argparse.Namespace) -> int:
    print("\n".join(presets_table()))
    return 0
