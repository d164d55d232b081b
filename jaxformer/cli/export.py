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
from jaxformer.checkpoints.peft import save_peft
from jaxformer.cli.args import UsageError, nonneg_int, output_folder
from jaxformer.model.lora import merge
from jaxformer.observe.words import plural
from jaxformer.training.adapters import frozen_base
from jaxformer.training.settings import TrainSettings
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
  jaxformer export --run runs/lora --peft out/adapter --hf out/merged --merge
        a LoRA run: its adapters as a PEFT folder, and the model with them merged
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
    e.add_argument("--hf", metavar="OUT", help="folder to write (created)")
    e.add_argument("--merge", action="store_true",
                   help="a LoRA run (train --lora-rank): write the frozen model with the adapters merged "
                        "(W + alpha / r * A B) to --hf")
    e.add_argument("--peft", metavar="OUT", help="a LoRA run: write its adapters alone as a PEFT folder "
                                                 "(adapter_config.json + adapter_model.safetensors)")
    e.add_argument("--step", type=nonneg_int, help="checkpoint step (default: the newest that verifies)")
    return e


def run(args: argparse.Namespace) -> int:
    if not (args.hf or args.peft):
        raise UsageError("export needs --hf OUT (the model) or --peft OUT (a LoRA run's adapters)")
    for flag, value in (("--hf", args.hf), ("--peft", args.peft)):
        if value:
            output_folder(value, flag)
    meta = checkpoint.read_meta(args.run, args.step) if args.step is not None \
        else checkpoint.newest_meta(args.run)
    if meta.get("param_dtype") == "float64":  # a --dtype float64 run: its params load as they are
        jax.config.update("jax_enable_x64", True)
    params, config, tokenizer, meta = load_run(args.run, state_template, args.step)
    settings = TrainSettings.from_dict(meta["settings"])
    lora = settings.lora()
    if lora is None and (args.merge or args.peft):
        raise UsageError(f"--{'merge' if args.merge else 'peft'} is for a LoRA run (train --lora-rank); "
                         f"{args.run} trained every parameter")
    if lora is not None and args.hf and not args.merge:
        raise UsageError(f"{args.run} is a LoRA run: its checkpoints hold adapters; --merge writes the "
                         "model with them merged, --peft the adapters alone")
    if args.peft:
        save_peft(args.peft, params, lora, settings.lora_base or "")
        print(f"wrote {args.peft} (PEFT LoRA adapters: rank {lora.rank}, alpha {lora.alpha:g}, "
              f"{', '.join(lora.targets)}): peft.PeftModel.from_pretrained(base_model, {args.peft!r})")
        if not args.hf:
            return 0
    if lora is not None:
        params = merge(frozen_base(settings, config), params, lora)
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
