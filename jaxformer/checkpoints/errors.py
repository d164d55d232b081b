"""What goes wrong with a checkpoint: every failure to find or read one is a
``CheckpointError`` (a ValueError) naming the path."""

from __future__ import annotations

import json


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not fit what was asked for."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files or arrays do not match the digests recorded when it was saved."""


class CheckpointReadError(CheckpointError):
    """Reading an intact checkpoint failed for another reason (out of memory, an I/O
    error, a sharding that does not fit): not damage, so nothing is set aside."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (disk full, permission denied, the folder
    removed); its partial folder was removed, earlier checkpoints are intact."""


class UnhealthyStateError(CheckpointError):
    """A state with non-finite values was not saved."""


def is_damage(e: BaseException) -> bool:
    """Whether a failure to read a checkpoint means its files are damaged: a missing
    file, or bytes that do not decode (bad JSON or text, a tensorstore data-loss or
    not-found error). Anything else (MemoryError, an OSError such as EIO, a sharding
    error) is not damage."""
    if isinstance(e, (FileNotFoundError, UnicodeDecodeError, json.JSONDecodeError)):
        return True
    return isinstance(e, ValueError) and any(code in str(e) for code in ("NOT_FOUND", "DATA_LOSS"))


def one_line(e: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line, cut to ``limit`` characters (for error messages
    that quote a library's failure)."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
