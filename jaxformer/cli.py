"""The ``jaxformer`` command: train, generate, compare-grads.

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
  jaxformer train --preset loopos --steps 300 --out runs/loopos
        train the loopos model on the built-in text; the run folder gets
        metrics.jsonl, loss.png and checkpoints/
  jaxformer train --preset tiny --steps 50 --out runs/tiny --grads manual
        the same loop with the hand-derived gradients
  jaxformer train --out runs/loopos --resume --steps 600
        continue a run from its latest checkpoint (its settings are reused)
  jaxformer generate --run runs/loopos --prompt "The " --max-new-tokens 200
        sample text from the run's latest checkpoint
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
"""

GENERATE_EPILOG = """\
examples:
  jaxformer generate --run runs/loopos --prompt "Once upon a time" --max-new-tokens 200
  jaxformer generate --run runs/loopos --prompt "The " --temperature 0      (greedy)
  jaxformer generate --run runs/loopos --prompt "The " --temperature 0.8 --top-k 20 --seed 3
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


def build_parser() -> argparse.ArgumentParser:
    from jaxformer.config import PRESETS
    from jaxformer.optim import OPTIMIZERS, SCHEDULES

    parser = _Parser(prog="jaxformer", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    t = sub.add_parser("train", help="train a model; writes metrics, a loss plot and checkpoints",
                       description="Train a model from a preset.", epilog=TRAIN_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--out", required=True, metavar="DIR", help="run folder (created)")
    t.add_argument("--preset", choices=list(PRESETS), help="model and training recipe (default: loopos)")
    t.add_argument("--grads", choices=["auto", "manual"],
                   help="gradient source: jax.grad (auto, default) or the hand-derived backward (manual)")
    t.add_argument("--steps", type=_positive_int, help="total training steps of the run (default 100)")
    t.add_argument("--resume", action="store_true",
                   help="continue from the run folder's latest checkpoint")
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

    g = sub.add_parser("generate", help="sample text from a trained run",
                       description="Sample text from a run's latest checkpoint.", epilog=GENERATE_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("--run", required=True, metavar="DIR", help="run folder written by `jaxformer train`")
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument("--max-new-tokens", type=_nonneg_int, default=200, metavar="N", help="default 200")
    g.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0: greedy (default 0.8)")
    g.add_argument("--top-k", type=_nonneg_int, default=0, metavar="K", help="sample among the K likeliest (0: all)")
    g.add_argument("--seed", type=_nonneg_int, default=0)
    g.add_argument("--step", type=_nonneg_int, metavar="N", help="use the checkpoint of step N (default: latest)")

    sub.add_parser("compare-grads", help="compare manual gradients with jax.grad (see its --help)",
                   add_help=False)
    sub.add_parser("bench", help="benchmark a training step: manual, jax.grad, PyTorch (see its --help)",
                   add_help=False)
    return parser


TRAIN_FLAGS = ("grads", "steps", "corpus", "tokenizer", "max_corpus_bytes", "val_fraction",
               "batch_size", "seq_len", "seed", "optimizer", "lr", "schedule", "warmup_steps",
               "clip_value", "clip_norm", "weight_decay", "momentum", "accum_steps", "dtype",
               "eval_every", "eval_batches", "log_every", "ckpt_every", "keep_checkpoints")


def _train_settings(args):
    from jaxformer import checkpoint
    from jaxformer.train import TrainSettings, settings_for

    flags = {name: getattr(args, name) for name in TRAIN_FLAGS}
    if args.resume:
        saved = TrainSettings.from_dict(checkpoint.read_meta(args.out)["settings"])
        given = {k: v for k, v in flags.items() if v is not None}
        if args.preset is not None:
            given["preset"] = args.preset
        settings = saved.replace(**given)
    else:
        settings = settings_for(args.preset or "loopos", **flags)
    for name in ("clip_value", "clip_norm"):  # 0 on the command line turns clipping off
        if getattr(args, name) == 0:
            settings = settings.replace(**{name: None})
    return settings


def cmd_train(args) -> int:
    settings = _train_settings(args)
    if settings.dtype == "float64":
        import jax

        jax.config.update("jax_enable_x64", True)
    import jax

    from jaxformer.params import count_params
    from jaxformer.train import train

    t0 = time.perf_counter()
    print(f"training {settings.preset} ({settings.grads} gradients, {settings.optimizer}, "
          f"lr {settings.lr}) for {settings.steps} steps on {jax.device_count()} "
          f"{jax.devices()[0].platform} device(s) -> {args.out}", file=sys.stderr)
    result = train(settings, args.out, resume=args.resume, progress=not args.no_progress)
    wall = time.perf_counter() - t0
    records = result.records
    if not records:
        print(f"{args.out} already trained for {settings.steps} steps; nothing to do")
        return 0
    first, last = records[0], records[-1]
    speed = [r["tokens_per_s"] for r in records[1:]] or [first["tokens_per_s"]]
    val = f", val loss {last['val_loss']:.4f}" if "val_loss" in last else ""
    print(f"{count_params(result.state.params):,} params, vocab {result.config.vocab_size}; "
          f"loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} "
          f"(step {last['step']}){val}; {sorted(speed)[len(speed) // 2]:.0f} tokens/s; {wall:.1f} s")
    print(f"run folder: {result.run_dir} (metrics.jsonl, loss.png, checkpoints/)")
    return 0


def cmd_generate(args) -> int:
    from jaxformer import checkpoint

    meta = checkpoint.read_meta(args.run, args.step)
    if meta.get("param_dtype") == "float64":
        import jax

        jax.config.update("jax_enable_x64", True)
    from jaxformer.generate import sample_text

    text = sample_text(args.run, args.prompt, args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, seed=args.seed, step=args.step)
    print(text)
    return 0


def cmd_compare_grads(argv) -> int:
    try:
        from jaxformer import compare
    except ImportError as e:
        raise UsageError(f"compare-grads is not available: {e}") from None
    code = compare.main(argv)
    return 0 if code is None else int(code)


def main(argv=None) -> int:
    """Run the ``jaxformer`` command with ``argv`` (default: sys.argv[1:]); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from jaxformer.checkpoint import CheckpointError
    from jaxformer.train import NonFiniteLossError

    try:
        if argv and argv[0] == "compare-grads":
            return cmd_compare_grads(argv[1:])
        if argv and argv[0] == "bench":  # its own parser and error handling
            from jaxformer.bench import main as bench_main
            return bench_main(argv[1:])
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        return {"train": cmd_train, "generate": cmd_generate}[args.command](args)
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
