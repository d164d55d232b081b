"""The ``jaxformer`` command: prepare, train, generate, presets, diagnose, compare-grads, bench,
export, doctor, tune, memory.

Each command is a module of this package with ``add_parser(subparsers)`` and
``run(args) -> int``; this one assembles them and dispatches. Bad input ends with
one ``error: ...`` line on stderr and exit code 2; a run stopped by a non-finite
loss exits with 1; a Ctrl-C ends any command with ``error: interrupted`` and exit
code 130 (``train`` first checkpoints the step it reached) (``cli.args.run_command``).
"""

from __future__ import annotations

import argparse
import signal
import sys

from jaxformer.cli import bench, compare_grads, diagnose, doctor, export, generate, plan, prepare, presets, train, tune
from jaxformer.cli.args import Parser, UsageError, exit_at_ctrl_c, run_command
from jaxformer.cli.platforms import cpu_only_without_tpu_probe
import jaxformer

DESCRIPTION = """\
Train a small transformer language model written as pure JAX functions, whose
gradients come from hand-derived backward passes (--grads manual, the default) or
from jax.grad (--grads auto), then sample text from it.
"""

EPILOG = """\
examples:
  jaxformer presets
        the presets: shape, parameter count, training recipe
  jaxformer prepare --corpus stdlib --tokenizer bpe --vocab-size 4096 --out data/stdlib
        tokenize a corpus once into token shards that `train --data` memory-maps
  jaxformer train --preset loopos --steps 300 --out runs/loopos
        train the loopos model on the built-in text; the run folder gets
        metrics.jsonl, loss.png and checkpoints/
  jaxformer train --preset tiny --steps 50 --out runs/tiny --grads auto
        the same loop with jax.grad's gradients instead of the hand-derived ones
  jaxformer train --out runs/loopos --resume --steps 600
        continue a run from its latest checkpoint (its settings are reused)
  jaxformer generate --run runs/loopos --prompt "The " --max-new-tokens 200
        sample text from the run's latest checkpoint
  jaxformer diagnose --run runs/loopos
        per-layer activation ranges and gradient norms of the latest checkpoint,
        and the first layer that makes a NaN or an infinity
  jaxformer compare-grads --help
        compare the manual gradients with jax.grad
  jaxformer doctor
        check this install on this device: the attention kernels against full
        attention, manual gradients against jax.grad, training, speed and MFU
  jaxformer memory --preset llama3.2-1b --seq-len 8192 --devices 8 --target tpu-v5e
        the meshes of 8 TPU v5e chips that fit the model, compiled ahead of time here
  jaxformer tune --preset gpt2 --compute-dtype bfloat16 --seq-len 1024
        time the Pallas kernels' launches on this GPU and keep the fastest

Run `jaxformer COMMAND --help` for the options of each command.
"""

# The subcommands in the order --help lists them: name -> module with add_parser and run.
COMMANDS = {"prepare": prepare, "train": train, "generate": generate, "presets": presets, "diagnose": diagnose,
            "compare-grads": compare_grads, "bench": bench, "export": export, "doctor": doctor, "tune": tune,
            "memory": plan}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="jaxformer", description=DESCRIPTION, epilog=EPILOG,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"jaxformer {jaxformer.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS.values():
        command.add_parser(subparsers)
    return parser


def _dispatch(argv: list[str]) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named against the command's own --help
        where = f"jaxformer {args.command}" if args.command else "jaxformer"
        raise UsageError(f"unrecognized arguments: {' '.join(extra)} (see `{where} --help`)")
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    args.argv = argv  # the command line, for the resume command of an interrupted run
    return COMMANDS[args.command].run(args)


def main(argv=None) -> int:
    """Run the ``jaxformer`` command with ``argv`` (default: sys.argv[1:]); returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    cpu_only_without_tpu_probe()  # before JAX starts: no libtpu probe on a machine without a TPU
    if argv is None and (not args or args[0] != "train"):  # a real command line with nothing to save
        signal.signal(signal.SIGINT, exit_at_ctrl_c)
    return run_command(_dispatch, args, exit_on_interrupt=argv is None)


if __name__ == "__main__":
    sys.exit(main())
