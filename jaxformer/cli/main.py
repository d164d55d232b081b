"""The ``jaxformer`` command: train, generate, diagnose, compare-grads.

Bad input (an unknown preset, a missing corpus, an invalid setting, a bad or
mismatched checkpoint) ends with one ``error: ...`` line on stderr and exit
code 2; a run stopped by a non-finite loss exits with 1.
"""

from __future__ import annotations

import argparse
import sys
import time

DESCRIPTION = """\
Train a small transformer language model written as pure JAX functions, whose
gradients come from jax.grad (--grads auto) or from hand-derived backward passes
(--grads manual), then sample text from it.
"""

EPILOG = """\
examples:
  jaxformer presets
        the presets: shape, parameter count, training recipe
  jaxformer train --preset loopos --steps 300 --out runs/loopos
        train the loopos model on the built-in text; the run folder gets
        metrics.jsonl, loss.png and checkpoints/
  jaxformer train --preset tiny --steps 50 --out runs/tiny --grads manual
        the same loop with the hand-derived gradients
  jaxformer train --out runs/loopos --resume --steps 600
        continue a run from its latest checkpoint (its settings are reused)
  jaxformer generate --run runs/loopos --prompt "The " --max-new-tokens 200
        sample text from the run's latest checkpoint
  jaxformer diagnose --run runs/loopos
        per-layer activation ranges and gradient norms of the latest checkpoint,
        and the first layer that makes a NaN or an infinity
  jaxformer compare-grads --help
        compare the manual gradients with jax.grad

Run `jaxformer COMMAND --help` for the options of each command.
"""

TRAIN_EPILOG = """\
Unset options come from the preset's training recipe (jaxformer.config.PRESET_TRAINING);
with --resume, from the checkpoint's settings. The model's vocab_size is the tokenizer's.

examples:
  jaxformer train --preset loopos --steps 300 --out runs/loopos
  jaxformer train --preset sunfish --corpus stdlib --tokenizer char --steps 500 --out runs/sun
  jaxformer train --preset tiny --optimizer sgd --lr 0.1 --clip-value 5 --steps 100 --out runs/t
  jaxformer train --out runs/loopos --resume --steps 600
  jaxformer train --preset tiny --d-model 64 --n-layers 4 --d-ff 256 --steps 200 --out runs/t4
  jaxformer train --config runs/t4/config.toml --lr 3e-3 --out runs/t4b
        every run folder holds its resolved settings as config.toml; flags override it
  jaxformer train --preset gpt2 --compute-dtype bfloat16 --mesh data=2,fsdp=4 --out runs/gpt2
        GPT-2 small's shape, batch split over 8 devices, params and optimizer state over 4
"""

GENERATE_EPILOG = """\
examples:
  jaxformer generate --run runs/loopos --prompt "Once upon a time" --max-new-tokens 200
  jaxformer generate --run runs/loopos --prompt "The " --temperature 0      (greedy)
  jaxformer generate --run runs/loopos --prompt "The " --temperature 0.8 --top-k 20 --seed 3
  jaxformer generate --run runs/loopos --prompt "The " --top-p 0.9 --num-samples 3

Sampling uses a key/value cache: one prefill of the prompt's last max_seq_len
tokens, then one cached step per token. When the cache is full the context
restarts as its last max_seq_len // 2 tokens (positions stay within the trained
table). --no-cache runs the whole sliding window per token instead.
"""


class UsageError(Exception):
    """Bad command-line input, reported as one line and exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, without the usage block
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _nonneg_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def version() -> str:
    """The installed distribution's version, else the package's __version__."""
    from importlib import metadata

    try:
        return metadata.version("jaxformer")
    except metadata.PackageNotFoundError:
        from jaxformer import __version__

        return __version__


def _train_epilog() -> str:
    """TRAIN_EPILOG and each preset's recipe, from config.PRESET_TRAINING."""
    from jaxformer.model.config import PRESET_TRAINING, PRESETS
    from jaxformer.observe.report import recipe_text

    recipes = "\n".join(f"  {name:<8} {recipe_text(PRESET_TRAINING.get(name, {}))}" for name in PRESETS)
    return (f"{TRAIN_EPILOG}\npreset recipes (the defaults of the options above; `jaxformer presets` "
            f"for shapes):\n{recipes}\nA recipe's warmup that does not fit a short run's decaying "
            f"schedule is cut to a tenth of its updates\n(the run says so; --warmup-steps sets it).\n")


# ModelConfig fields generate may change: how the model computes, not its shape.
GENERATE_MODEL_FLAGS = ("attention_impl", "attention_block", "loss_chunk", "remat", "compute_dtype")


def build_parser() -> argparse.ArgumentParser:
    from jaxformer.model.config import PRESETS
    from jaxformer.cli.flags import add_model_flags, flag_name
    from jaxformer.training.optim import OPTIMIZERS, SCHEDULES

    parser = _Parser(prog="jaxformer", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"jaxformer {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    t = sub.add_parser("train", help="train a model; writes metrics, a loss plot and checkpoints",
                       description="Train a model from a preset.", epilog=_train_epilog(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--out", required=True, metavar="DIR", help="run folder (created)")
    t.add_argument("--preset", choices=list(PRESETS), help="model and training recipe (default: loopos)")
    t.add_argument("--grads", choices=["auto", "manual"],
                   help="gradient source: jax.grad (auto, default) or the hand-derived backward (manual)")
    t.add_argument("--steps", type=_positive_int, help="total training steps of the run (default 100)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the run folder's newest checkpoint that verifies")
    t.add_argument("--allow-data-change", action="store_true",
                   help="with --resume: accept a corpus or tokenizer that differs from the recorded one")
    t.add_argument("--config", metavar="FILE",
                   help="TOML file with [model] and [train] tables (a run folder's config.toml); "
                        "flags override it")
    d = t.add_argument_group("data")
    d.add_argument("--corpus", metavar="SPEC",
                   help='"default" (built-in English text), "stdlib" (Python sources) or a file/folder path')
    d.add_argument("--tokenizer", choices=["byte", "char"], help="byte (256 ids) or char (the corpus's characters)")
    d.add_argument("--max-corpus-bytes", type=_positive_int, metavar="N", help="read at most N bytes of the corpus")
    d.add_argument("--val-fraction", type=float, metavar="F", help="held-out tail of the corpus (default 0.1)")
    d.add_argument("--batch-size", type=_positive_int, metavar="B", help="sequences per step")
    d.add_argument("--seq-len", type=_positive_int, metavar="T", help="tokens per sequence (<= the model's max_seq_len)")
    d.add_argument("--seed", type=_nonneg_int, help="seed of the params init and the batch order")
    o = t.add_argument_group("optimizer")
    o.add_argument("--optimizer", choices=list(OPTIMIZERS))
    o.add_argument("--lr", type=float, help="(peak) learning rate")
    o.add_argument("--schedule", choices=list(SCHEDULES), help="learning-rate schedule after the warmup")
    o.add_argument("--warmup-steps", type=_nonneg_int, metavar="N")
    o.add_argument("--schedule-steps", type=_positive_int, metavar="N",
                   help="the schedule's horizon (default: --steps; a resumed run keeps its own)")
    o.add_argument("--clip-value", type=float, metavar="V", help="clip each gradient entry to [-V, V] (0: off)")
    o.add_argument("--clip-norm", type=float, metavar="N", help="clip the gradient's global norm to N (0: off)")
    o.add_argument("--weight-decay", type=float, metavar="W")
    o.add_argument("--momentum", type=float, metavar="M", help="for --optimizer momentum (default 0.9)")
    o.add_argument("--accum-steps", type=_positive_int, metavar="K", help="average K micro-batches per update")
    o.add_argument("--dtype", choices=["float32", "float64"], help="params dtype (default float32)")
    r = t.add_argument_group("logging and checkpoints")
    r.add_argument("--eval-every", type=_nonneg_int, metavar="N", help="validation loss every N steps (0: at the end only)")
    r.add_argument("--eval-batches", type=_positive_int, metavar="N", help="validation batches per evaluation")
    r.add_argument("--log-every", type=_positive_int, metavar="N", help="a metrics.jsonl line every N steps")
    r.add_argument("--ckpt-every", type=_nonneg_int, metavar="N", help="checkpoint every N steps (0: at the end only)")
    r.add_argument("--keep-checkpoints", type=_positive_int, metavar="N", help="latest checkpoints kept (default 3)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    m = t.add_argument_group("devices and processes")
    m.add_argument("--mesh", metavar="SPEC",
                   help="device mesh data=N,fsdp=M: the batch splits over N*M devices, params and "
                        "optimizer state over M (default: every device on data)")
    m.add_argument("--coordinator", metavar="HOST:PORT",
                   help="multi-process run: process 0's address (or JAX_COORDINATOR_ADDRESS)")
    m.add_argument("--num-processes", type=_positive_int, metavar="N",
                   help="multi-process run: number of processes (or JAX_NUM_PROCESSES)")
    m.add_argument("--process-id", type=_nonneg_int, metavar="I",
                   help="multi-process run: this process's index (or JAX_PROCESS_ID)")
    add_model_flags(t)

    g = sub.add_parser("generate", help="sample text from a trained run",
                       description="Sample text from a run's latest checkpoint.", epilog=GENERATE_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("--run", required=True, metavar="DIR", help="run folder written by `jaxformer train`")
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument("--max-new-tokens", type=_nonneg_int, default=200, metavar="N", help="default 200")
    g.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0: greedy (default 0.8)")
    g.add_argument("--top-k", type=_nonneg_int, default=0, metavar="K", help="sample among the K likeliest (0: all)")
    g.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample among the likeliest tokens whose probability sums to P, in (0, 1] (default 1: all)")
    g.add_argument("--num-samples", type=_positive_int, default=1, metavar="N",
                   help="continuations of the prompt, sampled side by side (default 1)")
    g.add_argument("--no-cache", action="store_true",
                   help="run the whole window per token instead of the key/value cache (the reference)")
    g.add_argument("--seed", type=_nonneg_int, default=0)
    g.add_argument("--step", type=_nonneg_int, metavar="N", help="use the checkpoint of step N (default: latest)")
    add_model_flags(g, title="model computation (the shape comes from the checkpoint; only "
                             f"{', '.join(flag_name(n) for n in GENERATE_MODEL_FLAGS)} apply)")

    sub.add_parser("presets", help="list the presets: shape, parameter count, training recipe",
                   description="The presets: model shape, parameter count for the byte "
                               "tokenizer (vocab 256) and training recipe.")
    _add_diagnose_parser(sub)
    sub.add_parser("compare-grads", help="compare manual gradients with jax.grad (see its --help)",
                   add_help=False)
    sub.add_parser("bench", help="benchmark a training step: manual, jax.grad, PyTorch (see its --help)",
                   add_help=False)
    return parser


TRAIN_FLAGS = ("grads", "steps", "corpus", "tokenizer", "max_corpus_bytes", "val_fraction",
               "batch_size", "seq_len", "seed", "optimizer", "lr", "schedule", "warmup_steps", "schedule_steps",
               "clip_value", "clip_norm", "weight_decay", "momentum", "accum_steps", "dtype",
               "eval_every", "eval_batches", "log_every", "ckpt_every", "keep_checkpoints", "mesh")


def _train_settings(args):
    """Settings from (lowest first) the preset's recipe or the resumed checkpoint's
    settings, the --config file, the flags. A clipping threshold of 0 means off."""
    from jaxformer.checkpoints import checkpoint
    from jaxformer.training.configfile import off_is_zero, read_config, settings_from_file
    from jaxformer.cli.flags import model_overrides
    from jaxformer.training.loop import TrainSettings, settings_for

    flags = {name: getattr(args, name) for name in TRAIN_FLAGS}
    model = model_overrides(args)
    if args.resume:
        saved = TrainSettings.from_dict(checkpoint.newest_meta(args.out)["settings"])
        given, file_model = {}, {}
        if args.config:
            file_model, given = read_config(args.config)
        given.update({k: v for k, v in flags.items() if v is not None})
        if args.preset is not None:
            given["preset"] = args.preset
        given["model"] = {**saved.model, **file_model, **model}
        settings = saved.replace(**given)
    elif args.config:
        settings = settings_from_file(args.config, args.preset, **flags, model=model)
    else:
        settings = settings_for(args.preset or "loopos", **flags, model=model)
    return off_is_zero(settings)


def cmd_train(args) -> int:
    from jaxformer.training import distributed

    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    settings = _train_settings(args)
    if settings.dtype == "float64":
        import jax

        jax.config.update("jax_enable_x64", True)
    import jax

    settings.validate()  # before the banner: a bad setting is the only line
    from jaxformer.training.loop import train

    t0 = time.perf_counter()
    main = jax.process_index() == 0
    log = (lambda line: print(line, file=sys.stderr)) if main else None
    print(f"training -> {args.out} ({jax.device_count()} {jax.devices()[0].platform} device(s) "
          f"in {jax.process_count()} process(es))", file=sys.stderr)
    result = train(settings, args.out, resume=args.resume, progress=not args.no_progress and main,
                   log=log, allow_data_change=args.allow_data_change)
    wall = time.perf_counter() - t0
    records = result.records
    if not main:
        return 0
    if not records:
        print(f"{args.out} already trained for {settings.steps} steps; nothing to do")
        return 0
    print(_train_summary(result, wall))
    print(f"run folder: {result.run_dir} (config.toml, metrics.jsonl, loss.png, checkpoints/)")
    return 0


def _train_summary(result, wall: float) -> str:
    """One line: params, the loss from first to last record, and each speed named."""
    from jaxformer.model.params import count_params

    first, last, t = result.records[0], result.records[-1], result.timing
    val = f", val loss {last['val_loss']:.4f}" if "val_loss" in last else ""
    steady = (f"{t['steady_tokens_per_s']:,.0f} tokens/s steady state (steps after the first, "
              f"validation and checkpoints excluded)" if t.get("steady_tokens_per_s")
              else "no steady-state steps")
    return (f"{count_params(result.state.params):,} params, vocab {result.config.vocab_size}; "
            f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} "
            f"(step {last['step']}){val}; {steady}; compile + first step {t['compile_s']:.1f} s; "
            f"{wall:.1f} s wall in all")


def cmd_presets(args) -> int:
    from jaxformer.observe.report import presets_table

    print("\n".join(presets_table()))
    return 0


def cmd_generate(args) -> int:
    from jaxformer.checkpoints import checkpoint
    from jaxformer.cli.flags import flag_name, model_overrides

    overrides = model_overrides(args)
    shape = sorted(set(overrides) - set(GENERATE_MODEL_FLAGS))
    if shape:
        raise UsageError(f"generate takes the model's shape from the checkpoint; "
                         f"{', '.join(flag_name(n) for n in shape)} cannot change it")

    meta = checkpoint.read_meta(args.run, args.step) if args.step is not None \
        else checkpoint.newest_meta(args.run)
    if meta.get("param_dtype") == "float64":
        import jax

        jax.config.update("jax_enable_x64", True)
    from jaxformer.inference.generate import sample_texts

    timing = {}
    texts = sample_texts(args.run, args.prompt, args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k, top_p=args.top_p, seed=args.seed, step=args.step,
                         num_samples=args.num_samples, use_cache=not args.no_cache, timing=timing,
                         model=overrides)
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i + 1} of {len(texts)}")
        print(text)
    if timing:
        how = ("no cache; compile included" if timing["compile_s"] is None else
               f"key/value cache; compile {timing['compile_s']:.2f} s, not counted")
        print(f"{args.num_samples} x {args.max_new_tokens} tokens in {timing['run_s']:.2f} s: "
              f"{1e3 * timing['s_per_token']:.2f} ms per token position ({how})", file=sys.stderr)
    return 0


DIAGNOSE_EPILOG = """\
Runs the checkpoint's next training batch eagerly through the hand-derived forward and
backward, layer by layer, and prints each stage's activation range and gradient norm,
and the first stage whose output or gradient is NaN or infinite.

examples:
  jaxformer diagnose --run runs/loopos
  jaxformer diagnose --run runs/loopos --step 200
"""


def _add_diagnose_parser(sub) -> None:
    d = sub.add_parser("diagnose", help="per-layer activation ranges and gradient norms of a checkpoint",
                       description="Find the layer that makes a NaN or an infinity.",
                       epilog=DIAGNOSE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("--run", required=True, metavar="DIR", help="run folder written by `jaxformer train`")
    d.add_argument("--step", type=_nonneg_int, metavar="N",
                   help="the checkpoint of step N (default: the newest that verifies)")


def cmd_diagnose(args) -> int:
    from jaxformer.checkpoints import checkpoint

    meta = checkpoint.read_meta(args.run, args.step) if args.step is not None \
        else checkpoint.newest_meta(args.run)
    if meta.get("param_dtype") == "float64":
        import jax

        jax.config.update("jax_enable_x64", True)
    from jaxformer.training.diagnose import diagnose_run

    print(diagnose_run(args.run, args.step))
    return 0


def cmd_compare_grads(argv) -> int:
    try:
        from jaxformer.tools import compare
    except ImportError as e:
        raise UsageError(f"compare-grads is not available: {e}") from None
    code = compare.main(argv)
    return 0 if code is None else int(code)


def main(argv=None) -> int:
    """Run the ``jaxformer`` command with ``argv`` (default: sys.argv[1:]); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from jaxformer.checkpoints.checkpoint import CheckpointError
    from jaxformer.training.loop import NonFiniteLossError

    try:
        if argv and argv[0] == "compare-grads":
            return cmd_compare_grads(argv[1:])
        if argv and argv[0] == "bench":  # its own parser and error handling
            from jaxformer.tools.bench import main as bench_main
            return bench_main(argv[1:])
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        return {"train": cmd_train, "generate": cmd_generate, "presets": cmd_presets,
                "diagnose": cmd_diagnose}[args.command](args)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except (UsageError, CheckpointError, ValueError, OSError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except NonFiniteLossError as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
