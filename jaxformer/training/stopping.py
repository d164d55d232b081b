"""Stopping a run safely: SIGINT (Ctrl-C) and SIGTERM (Slurm, Kubernetes, spot machines).

Within ``StopRequests()``, the first SIGINT or SIGTERM only sets a flag: the loop
finishes the step in flight, checkpoints the step reached (unless saved already),
flushes its records and raises ``Interrupted`` (exit code 130 for SIGINT, 143 for
SIGTERM). A second Ctrl-C raises KeyboardInterrupt at once: a checkpoint being
written is left in orbax's temporary folder, which is ignored, so every saved
checkpoint stays intact.

Several processes (``jax.distributed``) stop at the same step through JAX's
preemption sync point (``multihost_utils.reached_preemption_sync_point``, as orbax
uses): the coordination service catches SIGTERM in any process, tells every
process, and they agree on the step to checkpoint (the largest step any process has
reached, plus one). A Ctrl-C in one process is sent on to itself as SIGTERM, JAX's
preemption notice, so it too stops the whole job at one step: the process that got
the Ctrl-C exits 130, every other one 143 ("a stop notice from another process").
The preemption service is JAX's default (``jax_enable_preemption_service``).
"""

from __future__ import annotations

import os
import signal
import threading

import jax
from jax.experimental import multihost_utils

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Interrupted(Exception):
    """A run stopped by a signal after checkpointing the step it reached."""

    def __init__(self, signum: int | None, step: int, checkpoint_dir, saved_now: bool):
        """signum None: another process of the job was signalled (JAX's preemption notice)."""
        self.signum, self.step, self.checkpoint_dir, self.saved_now = signum, step, checkpoint_dir, saved_now
        self.exit_code = EXIT_CODES.get(signum, EXIT_CODES[signal.SIGTERM])
        how = "saved" if saved_now else "already saved"
        by = (signal.Signals(signum).name if signum is not None
              else "a stop notice (SIGTERM or Ctrl-C to a process of this job)")
        super().__init__(f"interrupted by {by} at step {step}; checkpoint {checkpoint_dir} ({how})")


class StopRequests:
    """The loop's signal handlers (installed only in the main thread; a no-op elsewhere)."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}
        self._multi = jax.process_count() > 1

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.signum is not None:
            # the second Ctrl-C: abort at once; the process is on its way out, more are ignored
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            self._old.pop(signal.SIGINT, None)
            raise KeyboardInterrupt
        self.signum = signum
        if self._multi and signum == signal.SIGINT:
            # hand it to the coordination service's SIGTERM handler: every process stops
            signal.signal(signal.SIGINT, self._handle)
            os.kill(os.getpid(), signal.SIGTERM)

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            # with several processes, SIGTERM belongs to the coordination service
            for signum in (signal.SIGINT,) if self._multi else (signal.SIGINT, signal.SIGTERM):
                self._old[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._old.items():
            signal.signal(signum, handler)
        self._old = {}

    def requested(self, step: int) -> bool:
        """Whether to stop after ``step`` (call once per step, with every process).
        Several processes: True at the same step in all of them, once any got SIGTERM or
        SIGINT (``signum`` stays None in a process that got neither)."""
        if self._multi:
            if multihost_utils.reached_preemption_sync_point(step):
                return True
            return False
        return self.signum is not None
