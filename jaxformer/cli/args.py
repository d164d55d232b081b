"""What every command shares: argument types and the one error style.

Bad input (a bad flag, an unknown preset, a missing file, an invalid setting, a
bad or mismatched checkpoint) ends with one ``error: ...`` line on stderr and
exit code 2, never a usage block or a traceback; a run stopped by a non-finite
loss exits with 1, an interrupted one with 130. ``Parser`` turns argparse's own
errors into ``UsageError``; ``run_command`` turns exceptions into exit codes.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from jaxformer.checkpoints.checkpoint import CheckpointError
from jaxformer.training.loop import NonFiniteLossError


class UsageError(Exception):
    """Bad command-line input, reported as one line and exit code 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise UsageError (one line, no usage block)."""

    def error(self, message):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def int_at_least(minimum: int, words: str) -> Callable[[str], int]:
    """argparse type: an integer >= minimum; ``words`` names that range in the error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {words}, got {text!r}")
        return value

    return parse


positive_int = int_at_least(1, "a positive integer")  # argparse type: an integer >= 1
nonneg_int = int_at_least(0, "an integer >= 0")  # argparse type: an integer >= 0


def number(kind: type) -> Callable[[str], int | float]:
    """argparse type: ``kind(text)`` (int or float), with a message naming what was expected."""
    def parse(text):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    parse.__name__ = kind.__name__
    return parse


def output_folder(path, flag: str) -> None:
    """Check, before any work, that ``path`` can be the folder a command writes (``flag``
    names the option): UsageError when it, or the nearest part of it that exists, is a
    file. Catching it first spares a long run that would fail at its first write."""
    for part in (Path(path), *Path(path).parents):
        if part.exists():
            if not part.is_dir():
                what = f"{flag} {path} is" if part == Path(path) else f"{flag} {path}: {part} is"
                raise UsageError(f"{what} a file, not a folder; choose another path")
            return


def one_line(e: BaseException) -> str:
    """The exception's message on one line (its type's name when it has none)."""
    return " ".join(str(e).split()) or type(e).__name__


def exit_now(code: int) -> None:
    """End the process at once with ``code``, its output flushed: no interpreter teardown,
    which native threads still running (an XLA compile, torch's pool, JAX's distributed
    runtime) can crash."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def error_line(message: str) -> None:
    """``error: message`` on stderr, on a line of its own: a progress bar still drawn (tqdm
    writes it without a newline) is closed first, so the error never joins its line."""
    for bar in list(getattr(tqdm, "_instances", ())):  # the live bars (tqdm's own registry)
        bar.close()
    print(f"error: {message}", file=sys.stderr)


def exit_at_ctrl_c(signum, frame) -> None:
    """A SIGINT handler that ends the process at once with ``error: interrupted`` and 130.
    Raising KeyboardInterrupt is not enough for a long native computation: when the signal
    lands inside a callback (JAX's garbage-collection hook) Python prints "Exception
    ignored" and carries on. Commands with nothing to save use this (train checkpoints)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    error_line("interrupted")
    exit_now(130)


def run_command(fn: Callable[..., int | None], *args, exit_on_interrupt: bool = False, **kwargs) -> int:
    """Call ``fn(*args, **kwargs)`` and return its exit code (None counts as 0), reporting
    exceptions in the one error style: bad input 2, a non-finite loss 1, Ctrl-C 130;
    ``--help`` and ``--version`` (argparse's SystemExit) return their own code.

    exit_on_interrupt: after a Ctrl-C's one line, end the process at once (``os._exit``):
    work still running in native threads (an XLA compile, torch's thread pool) can crash
    the interpreter's teardown. Only for a real command line, never in-process."""
    try:
        code = fn(*args, **kwargs)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except (UsageError, CheckpointError, ValueError, OSError) as e:
        error_line(one_line(e))
        return 2
    except NonFiniteLossError as e:
        error_line(one_line(e))
        return 1
    except KeyboardInterrupt:
        error_line("interrupted")
        if exit_on_interrupt:
            exit_now(130)
        return 130
    return 0 if code is None else int(code)
