"""`jaxformer export`: a trained run's params as a Hugging Face folder: the family the model was
imported as (Llama, Mistral, Qwen2, Qwen3, GPT-2), else GPT-2 for the GPT-2 options and Llama
for the modern block's (checkpoints/hf.py chooses)."""

from __future__ import annotations

import argparse
from pathlib import Path

import jax

from jaxformer.checkpoints import checkpoint
from jaxformer.checkpoints.hf import write_hf
from jaxformer.checkpoints.runs import load_run
from jaxformer.cli.args import nonneg_int, output_folder
from jaxformer.observe.words import plural
from jaxformer.training.step import state_template

TOKENIZER_JSON = "tokenizer.json"

EPILOG = """examples:
  jaxformer export --run runs/ft --hf out/gpt2-ft
        config.json + model.safetensors (+ tokenizer.json for a subword tokenizer):
        transformers.GPT2LMHeadModel.from_pretrained("out/gpt2-ft")
  jaxformer export --run runs/llama-ft --hf out/llama-ft
        a run of the modern block (RMS norm, rotary, gated MLP): LlamaForCausalLM
  jaxformer export --run runs/qwen3-ft --hf out/qwen3-ft
        a run started from a Qwen3 folder (train --init-from): Qwen3ForCausalLM again
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    e = subparsers.add_parser("export", help="write a run's model as a Hugging Face folder (GPT-2, Llama, Mistral, Qwen2, Qwen3)",
                              description="Write a run's params as a Hugging Face folder: GPT-2 "
                                          "(pre-LN, layer norm, learned positions, biases, no head "
                                          "bias) or, for a model with the modern block's options, "
                                          "Llama (pre-norm RMS norm, rotary positions, gated MLP, "
                                          "grouped-query attention, no QK-norm, no head bias); "
                                          "a model imported from a Mistral, Qwen2 or Qwen3 folder "
                                          "is written as that family. "
                                          "An option the format cannot hold is refused by name.",
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("--run", required=True, metavar="DIR", help="run folder")
    e.add_argument("--hf", required=True, metavar="OUT", help="folder to write (created)")
    e.add_argument("--step", type=nonneg_int, help="checkpoint step (default: the newest that verifies)")
    return e


def run(args: argparse.Namespace) -> int:
    output_folder(args.hf, "--hf")
    meta = checkpoint.read_meta(args.run, args.step) if args.step is not None \
        else checkpoint.newest_meta(args.run)
    if meta.get("param_dtype") == "float64":  # a --dtype float64 run: its params load as they are
        jax.config.update("jax_enable_x64", True)
    params, config, tokenizer, _ = load_run(args.run, state_template, args.step)
    out, kind = write_hf(args.hf, params, config)
    files = ["config.json", "model.safetensors"]
    own = Path(out) / TOKENIZER_JSON
    if tokenizer.kind == "hf":  # a subword tokenizer travels with the model, as on the hub
        own.write_text(tokenizer.to_dict()["json"], encoding="utf-8")
        files.append(TOKENIZER_JSON)
    elif own.exists():  # left by an earlier export here: it is not this model's
        own.unlink()
    print(f"wrote {out} ({kind}: {', '.join(files)}): {plural(config.n_layers, 'layer')}, d_model "
          f"{config.d_model}, vocab {config.vocab_size} ({type(tokenizer).__name__})")
    return 0
