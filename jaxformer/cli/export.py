"""`jaxformer export`: a trained run's params as a Hugging Face folder: the family the model was
imported as (Llama, Mistral, Qwen2, Qwen3, GPT-2), else GPT-2 for the GPT-2 options and Llama
for the modern block's (formats/hf.py chooses). A LoRA run's adapters as a PEFT folder
(formats/peft.py) and its frozen base; each folder with the tokenizer and chat files
(formats/hf_chat_files.py) of where the run came from (formats/run_source.py)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import jax

from jaxformer.checkpoints import checkpoint
from jaxformer.checkpoints.runs import load_run
from jaxformer.cli.args import UsageError, nonneg_int, output_folder
from jaxformer.formats.hf import write_hf
from jaxformer.formats.hf_chat_files import FILES, write_chat_files
from jaxformer.formats.peft import save_peft
from jaxformer.formats.run_source import base_name, run_chat
from jaxformer.model.lora import merge
from jaxformer.observe.words import plural
from jaxformer.training.adapters import frozen_base
from jaxformer.training.settings import TrainSettings
from jaxformer.training.step import state_template

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
  jaxformer export --run runs/lora --peft out/adapter --base out/base
        the adapters and their frozen base, which adapter_config.json names:
        peft.AutoPeftModelForCausalLM.from_pretrained("out/adapter")

A subword tokenizer travels with each folder (tokenizer.json), and with it the chat
template and special tokens (tokenizer_config.json) and generation_config.json (eos_token_id:
the eos and end-of-turn ids) of the model the run started from (a LoRA run's base, the
--init-from model whose tokenizer it reads) or of the chat data it trained on:
transformers' generate stops at the end of a turn, `generate --init-from OUT --chat` chats.
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
                                                 "(adapter_config.json + adapter_model.safetensors), naming "
                                                 "as its base --base's folder, else the folder or hub id the "
                                                 "run started from (a GGUF file's: the hub repository it "
                                                 "records)")
    e.add_argument("--base", metavar="OUT", help="a LoRA run: write its frozen model (the adapters' base) as a "
                                                 "Hugging Face folder; --peft's adapter names it")
    e.add_argument("--step", type=nonneg_int, help="checkpoint step (default: the newest that verifies)")
    return e


def run(args: argparse.Namespace) -> int:
    if not (args.hf or args.peft or args.base):
        raise UsageError("export needs --hf OUT (the model), --peft OUT (a LoRA run's adapters) or --base OUT "
                         "(a LoRA run's frozen model)")
    outs = [(flag, value) for flag, value in (("--hf", args.hf), ("--peft", args.peft), ("--base", args.base))
            if value]
    for flag, value in outs:
        output_folder(value, flag)
    for i, (flag, value) in enumerate(outs):
        for other, second in outs[i + 1:]:
            if Path(value).resolve() == Path(second).resolve():
                raise UsageError(f"{flag} and {other} name the same folder {value}; give each its own")
    meta = checkpoint.read_meta(args.run, args.step) if args.step is not None \
        else checkpoint.newest_meta(args.run)
    if meta.get("param_dtype") == "float64":  # a --dtype float64 run: its params load as they are
        jax.config.update("jax_enable_x64", True)
    params, config, tokenizer, meta = load_run(args.run, state_template, args.step)
    settings = TrainSettings.from_dict(meta["settings"])
    lora = settings.lora()
    if lora is None and (args.merge or args.peft or args.base):
        flag = "--merge" if args.merge else "--peft" if args.peft else "--base"
        raise UsageError(f"{flag} is for a LoRA run (train --lora-rank); {args.run} trained every parameter")
    if lora is not None and args.hf and not args.merge:
        raise UsageError(f"{args.run} is a LoRA run: its checkpoints hold adapters; --merge writes the "
                         "model with them merged, --peft the adapters alone")
    chat, where = run_chat(settings, tokenizer) if tokenizer.kind == "hf" else (None, "")
    base = frozen_base(settings, config) if lora is not None and (args.base or args.hf) else None
    if args.base:
        write_model(args.base, base, config, tokenizer, chat, where, "the frozen model, ")
    if args.peft:
        write_adapters(args, params, lora, settings, tokenizer, chat)
    if args.hf:
        what = "the adapters merged, " if lora is not None else ""
        write_model(args.hf, params if lora is None else merge(base, params, lora), config, tokenizer, chat,
                    where, what)
    return 0


def write_model(folder, params, config, tokenizer, chat, where: str, what: str) -> None:
    """A Hugging Face folder of ``params``, with the tokenizer and chat files of a subword
    tokenizer (as on the hub), and its line (``what``: its first words)."""
    out, kind = write_hf(folder, params, config)
    files = ["config.json", "model.safetensors"]
    if tokenizer.kind == "hf":
        files += write_chat_files(out, tokenizer, chat)
    else:  # byte or char ids: no file of transformers' reads them; an earlier export's are not this model's
        for name in FILES:
            (Path(out) / name).unlink(missing_ok=True)
    print(f"wrote {out} ({kind}: {', '.join(files)}): {what}{plural(config.n_layers, 'layer')}, d_model "
          f"{config.d_model}, vocab {config.vocab_size} ({type(tokenizer).__name__}){chat_words(chat, where)}")


def chat_words(chat, where: str) -> str:
    """What the export's line says of the chat files: the template's source, or why none."""
    if chat is None:
        return f"; no chat template ({where})" if where else ""
    return f"; chat template and stop ids {list(chat.stop_ids)} from {where}"


def write_adapters(args, params, lora, settings, tokenizer, chat) -> None:
    """The PEFT folder of a LoRA run's adapters, naming a base PEFT resolves, and its line."""
    if args.base:
        name, why = os.path.abspath(args.base), f"the frozen model written to {args.base}"
    else:
        name, why = base_name(settings.lora_base)
    save_peft(args.peft, params, lora, name or "")
    files = ["adapter_config.json", "adapter_model.safetensors"]
    if tokenizer.kind == "hf":
        files += write_chat_files(args.peft, tokenizer, chat)
    load = (f"peft.AutoPeftModelForCausalLM.from_pretrained({args.peft!r})" if name else
            f"peft.PeftModel.from_pretrained(base_model, {args.peft!r})")
    named = f"base {name} ({why})" if name else f"no base ({why}; --base OUT writes the frozen model as a " \
                                                   "folder the adapter names)"
    print(f"wrote {args.peft} (PEFT LoRA adapters: rank {lora.rank}, alpha {lora.alpha:g}, "
          f"{', '.join(lora.targets)}; {', '.join(files)}), naming {named}: {load}")
