"""orbax's log noise: its INFO lines on every save and restore, and the tracebacks
its worker threads log and leave behind when a read fails (the failure is reported
once, as the CheckpointError it becomes)."""

from __future__ import annotations

import contextlib
import logging
import sys


def quiet_orbax() -> None:
    """orbax reports every save and restore at INFO level through absl logging: keep WARNING
    and up, less its warning at a preemption sync point (the run reports its stop itself)."""
    logger = logging.getLogger("absl")
    logger.setLevel(logging.WARNING)
    if _SYNC_POINT not in logger.filters:
        logger.addFilter(_SYNC_POINT)


class _SyncPointNotice(logging.Filter):
    """Drops orbax's "Reached preemption sync point" warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Reached preemption sync point" not in str(record.msg)


_SYNC_POINT = _SyncPointNotice()


@contextlib.contextmanager
def silenced():
    """No log lines (orbax logs the tracebacks of failed reads from its worker threads):
    a failed read is reported once, as the CheckpointError it becomes."""
    _drop_closed_loop_noise()
    loggers = [logging.getLogger(name) for name in ("absl", "orbax", "jax", "tensorstore")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class _OrbaxThreadErrors(logging.Filter):
    """Drops the ERROR records orbax logs from its own files (a failed async write logs
    its traceback from every worker thread): the failure is raised once, by the saver."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


_FILTER = _OrbaxThreadErrors()


@contextlib.contextmanager
def orbax_thread_noise():
    """Within: orbax's thread tracebacks are not logged (see _OrbaxThreadErrors); and
    the filter stays on the loggers while async writes may still fail afterwards."""
    _drop_closed_loop_noise()
    for name in ("absl", "orbax"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    for handler in logging.getLogger().handlers:
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)
    yield


def _drop_closed_loop_noise() -> None:
    """After a failed read, orbax's leftover read coroutines and callbacks fail again
    when collected or when they hit their closed asyncio loop, and Python prints each
    as an "Exception ignored" traceback; drop those (only those): the failure itself is
    reported once, as a CheckpointError."""
    hook = sys.unraisablehook
    if getattr(hook, "_jaxformer_filter", False):
        return

    def unraisable(info):
        code = getattr(info.object, "cr_code", None)
        if code is not None and "orbax" in code.co_filename:
            return
        if isinstance(info.exc_value, RuntimeError) and "Event loop is closed" in str(info.exc_value):
            return
        hook(info)

    unraisable._jaxformer_filter = True
    sys.unraisablehook = unraisable
