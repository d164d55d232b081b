"""What goes wrong with a checkpoint: every failure to find or read one is a
``CheckpointError`` (a ValueError) naming the path."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not fit what was asked for."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files or arrays do not match the digests recorded when it was saved."""


class UnhealthyStateError(CheckpointError):
    """A state with non-finite values was not saved."""


def one_line(e: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line, cut to ``limit`` characters (for error messages
    that quote a library's failure)."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
