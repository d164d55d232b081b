"""`jaxformer export`: a trained run's params as a Hugging Face GPT-2 folder."""

from __future__ import annotations

import argparse

from jaxformer.checkpoints.hf_gpt2 import write_hf_gpt2
from jaxformer.checkpoints.runs import load_run
from jaxformer.cli.args import nonneg_int
from jaxformer.observe.words import plural
from jaxformer.training.step import state_template

EPILOG = """examples:
  jaxformer export --run runs/ft --hf out/gpt2-ft
        config.json + model.safetensors: transformers.GPT2LMHeadModel.from_pretrained("out/gpt2-ft")
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    e = subparsers.add_parser("export", help="write a run's model as a Hugging Face GPT-2 folder",
                              description="Write a run's params as a Hugging Face GPT-2 folder "
                                          "(the model must be GPT-2-shaped: pre-LN, learned "
                                          "positions, biases, no head bias).",
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("--run", required=True, metavar="DIR", help="run folder")
    e.add_argument("--hf", required=True, metavar="OUT", help="folder to write (created)")
    e.add_argument("--step", type=nonneg_int, help="checkpoint step (default: the newest that verifies)")
    return e


def run(args: argparse.Namespace) -> int:
    params, config, tokenizer, _ = load_run(args.run, state_template, args.step)
    out = write_hf_gpt2(args.hf, params, config)
    print(f"wrote {out} (config.json, model.safetensors): {plural(config.n_layers, 'layer')}, d_model "
          f"{config.d_model}, vocab {config.vocab_size} ({type(tokenizer).__name__})")
    return 0
