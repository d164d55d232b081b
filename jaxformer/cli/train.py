"""``jaxformer train``: train a model from a preset, a config file or a run to resume."""

from __future__ import annotations

import argparse
import shlex
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxformer.checkpoints import checkpoint
from jaxformer.cli.args import UsageError, exit_now, nonneg_int, output_folder, positive_int
from jaxformer.cli.flags import (add_model_flags, add_setting_flags, model_overrides,
                                 refuse_weight_changes, setting_flags)
from jaxformer.formats.hf import read_hf, resolve_source
from jaxformer.model.config import PRESET_TRAINING, PRESETS, model_fields_of_weights
from jaxformer.model.params import count_params
from jaxformer.observe.report import recipe_text
from jaxformer.observe.words import plural
from jaxformer.training import distributed, liveness
from jaxformer.training.configfile import off_is_zero, read_config, settings_from_file
from jaxformer.training.adapters import base_line, read_base
from jaxformer.training.loop import train
from jaxformer.training.recipes import FINETUNE_RECIPES, Sources, recipe_name, size_to_run, sources_block
from jaxformer.training.run_data import model_tokenizer
from jaxformer.training.settings import TrainSettings, settings_for
from jaxformer.training.stopping import Interrupted

EPILOG = """\
Unset options come from the preset's training recipe (jaxformer.config.PRESET_TRAINING),
then the default each shows (TrainSettings'); with --resume, from the checkpoint's settings.
A run from a model (--init-from) starts from a fine-tuning recipe instead, lora (--lora-rank)
or full (jaxformer.training.recipes: AdamW, lr 2e-4 / 2e-5, cosine, 5% warmup, seq_len from
the data and the model, a chat folder's conversations packed into rows, 3 epochs, evaluations
and checkpoints sized to the run). The run prints every setting and where it came from.
The model's vocab_size is the tokenizer's.

examples:
  jaxformer train --preset loopos --steps 300 --out runs/loopos
  jaxformer train --preset sunfish --corpus stdlib --tokenizer char --steps 500 --out runs/sun
  jaxformer prepare --corpus stdlib --tokenizer bpe --vocab-size 4096 --out data/stdlib
  jaxformer train --preset sunfish --data data/stdlib --steps 500 --out runs/sun-bpe
  jaxformer train --preset tiny --optimizer sgd --lr 0.1 --clip-value 5 --steps 100 --out runs/t
  jaxformer train --preset loopos --optimizer muon --muon-lr 0.02 --lr 3e-3 --steps 300 --out runs/m
  jaxformer train --out runs/loopos --resume --steps 600
  jaxformer train --preset tiny --d-model 64 --n-layers 4 --d-ff 256 --steps 200 --out runs/t4
  jaxformer train --init-from m.gguf --data data/chats --lora-rank 8 --epochs 2 --mix data/web:0.2 --out r
        LoRA by its recipe, two passes over the chats, a fifth of each batch from data/web
  jaxformer train --config runs/t4/config.toml --lr 3e-3 --out runs/t4b
        every run folder holds its resolved settings as config.toml; flags override it
  jaxformer train --preset gpt2 --compute-dtype bfloat16 --mesh data=2,fsdp=4 --out runs/gpt2
        GPT-2 small's shape, batch split over 8 devices, params and optimizer state over 4

memory: the train step is compiled before the first step and its memory plan (XLA's
memory_analysis) checked against the free memory (host RAM on CPU); a step that does not
fit stops the run with the options that cut it (--ignore-memory-check tries anyway).
The gpt2 recipe (8 x 1024 tokens, --compute-dtype bfloat16) plans 11.4 GiB on one CPU
device (--grads auto: 22.2 GiB); with --attention-impl blockwise --loss-chunk 256
--remat block, 2.3 GiB (--grads auto: 3.8 GiB).
"""

# The flags that are TrainSettings fields of the same name (None when not given).
TRAIN_FLAGS = setting_flags(TrainSettings)
# the --help sections, in order ("": the command's own); TrainSettings' fields name theirs
GROUPS = ("", "data", "optimizer", "LoRA (adapters on a frozen model)", "logging and checkpoints",
          "devices and processes")


def epilog() -> str:
    """EPILOG and each preset's recipe, from config.PRESET_TRAINING."""
    width = max(map(len, PRESETS))
    recipes = "\n".join(f"  {name:<{width}}  {recipe_text(PRESET_TRAINING.get(name, {}))}" for name in PRESETS)
    return (f"{EPILOG}\npreset recipes (they replace the defaults shown above; `jaxformer presets` "
            f"for shapes):\n{recipes}\nA recipe's warmup that does not fit a short run's decaying "
            f"schedule is cut to a tenth of its updates\n(the run says so; --warmup-steps sets it).\n")


def add_parser(subparsers) -> argparse.ArgumentParser:
    t = subparsers.add_parser("train", help="train a model; writes metrics, a loss plot and checkpoints",
                              description="Train a model from a preset.", epilog=epilog(),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--out", required=True, metavar="DIR", help="run folder (created)")
    t.add_argument("--preset", choices=list(PRESETS), help="model and training recipe (default: loopos)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the run folder's newest checkpoint that verifies")
    t.add_argument("--allow-data-change", action="store_true",
                   help="with --resume: accept a corpus or tokenizer that differs from the recorded one")
    t.add_argument("--ignore-memory-check", action="store_true",
                   help="start even when the compiled step's memory plan exceeds the free memory "
                        "(the check runs before the first step; see 'memory' below)")
    t.add_argument("--init-from", metavar="DIR_OR_HUB_ID",
                   help="fine-tune a Hugging Face GPT-2 or Llama (a folder with config.json and "
                        "model.safetensors, or a hub id, downloaded): the model comes from it; "
                        "flags that change its shapes are refused")
    t.add_argument("--config", metavar="FILE",
                   help="TOML file with [model] and [train] tables (a run folder's config.toml); "
                        "flags override it")
    groups = add_setting_flags(t, TrainSettings, GROUPS)
    r, m = groups["logging and checkpoints"], groups["devices and processes"]
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    m.add_argument("--coordinator", metavar="HOST:PORT",
                   help="multi-process run: process 0's address (or JAX_COORDINATOR_ADDRESS)")
    m.add_argument("--num-processes", type=positive_int, metavar="N",
                   help="multi-process run: number of processes (or JAX_NUM_PROCESSES)")
    m.add_argument("--process-id", type=nonneg_int, metavar="I",
                   help="multi-process run: this process's index (or JAX_PROCESS_ID)")
    m.add_argument("--heartbeat-timeout", type=positive_int, metavar="S",
                   help=f"multi-process run: a process silent for S seconds is lost and the others "
                        f"stop (default {distributed.HEARTBEAT_TIMEOUT_S}, or "
                        f"{distributed.HEARTBEAT_ENV})")
    add_model_flags(t)
    return t


def train_settings(args: argparse.Namespace) -> TrainSettings:
    """Settings from (lowest first) the preset's recipe or the resumed checkpoint's
    settings, a fine-tuning recipe (--init-from), the --config file, the flags. A clipping
    threshold of 0 means off."""
    return resolve_settings(args)[0]


def resolve_settings(args: argparse.Namespace) -> tuple[TrainSettings, Sources]:
    """(train_settings, where each value came from: recipes.Sources)."""
    flags = {name: getattr(args, name) for name in TRAIN_FLAGS}
    given = {k: v for k, v in flags.items() if v is not None}
    model = model_overrides(args)
    sources = Sources()
    if args.resume:
        saved = TrainSettings.from_dict(checkpoint.newest_meta(args.out)["settings"])
        sources.layer("checkpoint", saved.to_dict())
        changes, file_model = {}, {}
        if args.config:
            file_model, changes = read_config(args.config)
            sources.layer(f"config {args.config}", changes)
        changes.update(given)
        if args.preset is not None:
            changes["preset"] = args.preset
        changes["model"] = {**saved.model, **file_model, **model}
        sources.layer("flag", given)
        return off_is_zero(saved.replace(**changes)), sources
    file_train = read_config(args.config)[1] if args.config else {}
    preset = args.preset or file_train.get("preset") or "loopos"
    sources.layer(f"preset {preset}", PRESET_TRAINING.get(preset, {}))
    if args.init_from:  # a fine-tune: its recipe under the file and the flags
        name = recipe_name(given.get("lora_rank", file_train.get("lora_rank", 0)))
        recipe = {k: v for k, v in FINETUNE_RECIPES[name].items() if k not in given and k not in file_train}
        sources.layer(f"recipe {name}", recipe)
        flags = {**flags, **recipe}
    if args.config:
        sources.layer(f"config {args.config}", file_train)
        settings = settings_from_file(args.config, args.preset, **flags, model=model)
    else:
        settings = settings_for(preset, **flags, model=model)
    sources.layer("flag", given)
    return off_is_zero(settings), sources


def imported_start(spec: str, settings: TrainSettings, flags: dict, seq_len_given: bool = False,
                   tokenizer_given: bool = False, recipe: str | None = None):
    """(params, settings whose model is the imported one's: GPT-2 or Llama) of ``--init-from spec``;
    a flag that would change the imported shapes is refused by name. A recipe's seq_len longer
    than the imported max_seq_len becomes that max_seq_len (said on stderr); a --seq-len
    longer is refused. The model's own tokenizer (its tokenizer.json, a GGUF file's) is the
    run's unless ``tokenizer_given`` (--tokenizer, a --config's tokenizer, or --data)."""
    folder = resolve_source(spec)
    own = None if tokenizer_given else model_tokenizer(folder)
    if own is not None:
        settings = settings.replace(tokenizer=own)
    params, config = read_hf(folder, np.float64 if settings.dtype == "float64" else np.float32)
    refuse_weight_changes(spec, flags, config)
    fields = config.to_dict()
    fields.pop("vocab_size")
    fixed = model_fields_of_weights()
    model = {k: v for k, v in settings.model.items() if k not in fixed}
    settings = settings.replace(model={**fields, **model})
    if settings.seq_len > config.max_seq_len:
        if seq_len_given:
            raise UsageError(f"--seq-len {settings.seq_len} exceeds the max_seq_len {config.max_seq_len} "
                             f"of the model from --init-from {spec}")
        print(f"seq_len {config.max_seq_len}: the max_seq_len of the model from --init-from {spec} (the "
              f"{recipe or settings.preset} recipe's {settings.seq_len} does not fit; --seq-len sets it)",
              file=sys.stderr)
        settings = settings.replace(seq_len=config.max_seq_len)
    return params, settings


def tokenizer_given(args: argparse.Namespace, settings: TrainSettings) -> bool:
    """Whether the run's tokenizer is chosen apart from --init-from's model: --tokenizer,
    a --config file's tokenizer, or prepared --data (which holds its own)."""
    if args.tokenizer is not None or settings.data:
        return True
    return bool(args.config) and "tokenizer" in read_config(args.config)[1]


def run(args: argparse.Namespace) -> int:
    output_folder(args.out, "--out")
    heartbeat = distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                       args.heartbeat_timeout,
                                       lambda: f"resume every process with: {resume_command(args)}")
    settings, sources = resolve_settings(args)
    if settings.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    init, recipe, max_seq_len = None, None, None
    if args.init_from and not args.resume:
        recipe = recipe_name(settings.lora_rank)
        if not sources.chosen("seq_len"):  # the recipe sizes it to the data and the model
            settings = settings.replace(seq_len=1)
        init, settings = imported_start(args.init_from, settings, model_overrides(args),
                                        seq_len_given=args.seq_len is not None,
                                        tokenizer_given=tokenizer_given(args, settings), recipe=recipe)
        max_seq_len = settings.model_config().max_seq_len
        if settings.lora_rank:  # the adapters' frozen base: read again on resume
            settings = settings.replace(lora_base=args.init_from)
            if settings.base_quant != "float":  # read again, its projections held as --base-quant says
                init = read_base(args.init_from, settings)
                print(base_line(init), file=sys.stderr)
            sources.of["lora_base"] = "--init-from"
    elif args.resume and settings.lora_rank and settings.lora_base:
        init = read_base(settings.lora_base, settings)  # as the run held it (base_quant)
    settings = size_to_run(settings, sources, recipe, max_seq_len)
    if recipe and not sources.chosen("seq_len") and settings.seq_len == max_seq_len \
            and sources.get("seq_len").startswith("model"):
        print(f"seq_len {max_seq_len}: the max_seq_len of the model from --init-from {args.init_from} (the "
              f"{recipe} recipe's rows do not fit; --seq-len sets it)", file=sys.stderr)
    settings.validate()  # before the banner: a bad setting is the only line

    t0 = time.perf_counter()
    main = jax.process_index() == 0
    log = (lambda line: print(line, file=sys.stderr)) if main else None
    if main:
        for line in sources_block(settings, sources):
            print(line, file=sys.stderr)
    print(f"training -> {args.out} ({plural(jax.device_count(), jax.devices()[0].platform + ' device')} "
          f"in {plural(jax.process_count(), 'process')})", file=sys.stderr)
    try:
        result = train(settings, args.out, resume=args.resume, progress=not args.no_progress and main,
                       log=log, allow_data_change=args.allow_data_change,
                       check_memory=not args.ignore_memory_check, init_params=init)
    except Interrupted as e:
        print(f"{e}; resume with: {resume_command(args)}", file=sys.stderr)
        _all_done(heartbeat)
        return _leave(heartbeat, e.exit_code)
    except Exception as e:
        if heartbeat is not None and liveness.may_be_a_lost_peer(e):
            liveness.settle(heartbeat)  # a lost process: the watch ends this one, with its line
        raise
    _all_done(heartbeat)
    wall = time.perf_counter() - t0
    if not main:
        return _leave(heartbeat, 0)
    if not result.records:
        print(f"{args.out} already trained for {plural(settings.steps, 'step')}; nothing to do")
        return _leave(heartbeat, 0)
    print(summary(result, wall))
    print(f"run folder: {result.run_dir} (config.toml, metrics.jsonl, loss.png, checkpoints/)")
    return _leave(heartbeat, 0)


def _all_done(heartbeat: int | None) -> None:
    """Several processes: wait for every one to finish (in JAX's recoverable mode the
    shutdown no longer waits for the others, and process 0 hosts the coordination service)."""
    if heartbeat is not None:
        multihost_utils.sync_global_devices("jaxformer train: done")
        liveness.finish(jax.process_count(), heartbeat)


def _leave(heartbeat: int | None, code: int) -> int:
    """Several processes, after their orderly end: leave at once with ``code`` (output
    flushed; every file is already written and closed). The interpreter's teardown of
    JAX's distributed runtime can abort a finished process (SIGABRT, "exception not
    rethrown", seen after a Ctrl-C's checkpoint) while a native thread is unwound."""
    if heartbeat is None:
        return code
    exit_now(code)


def resume_command(args: argparse.Namespace) -> str:
    """The command line that continues this run: the same one, with --resume."""
    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    return shlex.join(["jaxformer", *argv, *([] if "--resume" in argv else ["--resume"])])


def summary(result, wall: float) -> str:
    """One line: params, the loss from first to last record, and each speed named."""
    first, last, t = result.records[0], result.records[-1], result.timing
    val = f", val loss {last['val_loss']:.4f}" if "val_loss" in last else ""
    steady = (f"{t['steady_tokens_per_s']:,.0f} tokens/s steady state (step times after the "
              f"first alone)" if t.get("steady_tokens_per_s")
              else "no steady-state steps")
    return (f"{count_params(result.state.params):,} params, vocab {result.config.vocab_size}; "
            f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} "
            f"(step {last['step']}){val}; {steady}; compile + first step {t['compile_s']:.1f} s; "
            f"{wall:.1f} s wall in all")
