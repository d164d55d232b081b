"""``jaxformer prepare``: tokenize a corpus once into token shards for ``train --data``."""

from __future__ import annotations

import argparse
import os
import sys

from jaxformer.cli.args import positive_int
from jaxformer.data.prepare import DEFAULT_SHARD_TOKENS, prepare
from jaxformer.formats.hf import read_chat

EPILOG = """\
Sources (--corpus): "default", "stdlib", a text file, a folder (its files, recursively),
*.jsonl and *.parquet files (each record's --text-field), or hf:NAME[:CONFIG][:SPLIT]
(a Hugging Face dataset, streamed; needs `pip install 'jaxformer[data]'` and the network).
The last --val-fraction of every --shard-tokens span of the token stream is validation.
Writes DATA_DIR/train_*.bin, val_*.bin (uint16 or uint32), tokenizer.json, meta.json (last).
Re-running on a finished folder verifies it and does nothing else.
--tokenizer may name a model: a folder (tokenizer.json; tokenizer_config.json's chat_template
or chat_template.jinja) or a .gguf file; its tokenizer is used. Chat data, a JSONL file of
{"messages": [{"role", "content"}, ...]} or {"prompt", "completion"} records, is rendered
with that model's chat template, and a loss mask (1 on the assistant's tokens) is written
beside each shard (train_*.mask) for train --data.

examples:
  jaxformer prepare --corpus stdlib --tokenizer bpe --vocab-size 4096 --out data/stdlib
  jaxformer prepare --corpus docs.jsonl --text-field body --tokenizer gpt2 --out data/docs
  jaxformer prepare --corpus hf:wikitext:wikitext-103-raw-v1 --tokenizer tok.json --out data/wt103
  jaxformer prepare --corpus chats.jsonl --tokenizer SmolLM2.gguf --out data/chats
  jaxformer train --preset sunfish --data data/stdlib --steps 500 --out runs/sun
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("prepare", help="tokenize a corpus once into token shards (for train --data)",
                              description="Tokenize a corpus into flat token shards and a meta.json.",
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, metavar="SPEC", help="what to tokenize (see below)")
    p.add_argument("--tokenizer", required=True, metavar="KIND",
                   help="byte, char, bpe (with --vocab-size), gpt2, a path to a tokenizer.json, or a "
                        "model (a folder or a .gguf file: its tokenizer and chat template)")
    p.add_argument("--out", required=True, metavar="DATA_DIR", help="the folder to write (created)")
    p.add_argument("--vocab-size", type=positive_int, metavar="N", help="the vocabulary --tokenizer bpe learns")
    p.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                   help="validation share of every shard span (default 0.1)")
    p.add_argument("--shard-tokens", type=positive_int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                   help=f"tokens per shard span, train and val together (default {DEFAULT_SHARD_TOKENS})")
    p.add_argument("--text-field", default="text", metavar="F",
                   help="the field of a JSONL / Parquet / dataset record holding its text (default text)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def model_chat(spec: str):
    """The tokenizer and chat template of ``--tokenizer`` when it names a model (a folder or
    a .gguf file), else None."""
    if spec.lower().endswith(".gguf") or os.path.isdir(spec):
        return read_chat(spec)
    return None


def run(args: argparse.Namespace) -> int:
    prepare(args.corpus, args.tokenizer, args.out, val_fraction=args.val_fraction,
            shard_tokens=args.shard_tokens, text_field=args.text_field, vocab_size=args.vocab_size,
            progress=not args.no_progress, log=lambda line: print(line, file=sys.stderr),
            chat=model_chat(args.tokenizer))
    return 0
