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

The signal is acknowledged at once, on stderr: Python runs a signal handler only when the
main thread is back in the interpreter, and the main thread may be blocked for a whole step
(or a compilation) waiting on the device. So the handlers also write the signal's number
to a wakeup socket (``signal.set_wakeup_fd``, written by the interpreter's C-level handler
the moment the signal arrives) that a small thread reads: it prints that the signal was heard
and what follows (``notice``), while the main thread is still waiting. The loop keeps at
most two steps in flight, so the step it stops after is at most one step away.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading

import jax
from jax.experimental import multihost_utils
from tqdm import tqdm

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


def notice(signum: int, nth: int, multi: bool = False) -> str | None:
    """What the ``nth`` stop signal ``signum`` (SIGINT or SIGTERM) of a run makes it do, in one
    line; None for a repeated SIGTERM and for signals after the second Ctrl-C (nothing new)."""
    name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    if nth == 1:
        every = "; every process of the job stops at the same step" if multi else ""
        again = " (Ctrl-C again: quit without it)" if signum == signal.SIGINT else ""
        return f"{name} heard: stopping after the step in flight and saving a checkpoint{every}{again}"
    if nth == 2 and signum == signal.SIGINT:
        return "Ctrl-C again: quitting as soon as the step in flight returns, without that checkpoint"
    return None


def say(line: str) -> None:
    """A line on stderr that leaves the progress bar whole."""
    tqdm.write(line, file=sys.stderr)


class StopRequests:
    """The loop's signal handlers (installed only in the main thread; a no-op elsewhere) and
    the thread that acknowledges a signal at once (``notice``, through ``say``)."""

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}
        self._multi = jax.process_count() > 1
        self._wakeup = None  # (the old wakeup fd, our write end, the reading thread)
        self._heard = 0  # stop signals acknowledged (by the thread, else by the handler)

    def _handle(self, signum, frame):
        if self._wakeup is None:  # no acknowledging thread: say it here, late but said
            self._acknowledge(signum)
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
            self._listen()
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._old.items():
            signal.signal(signum, handler)
        self._old = {}
        if self._wakeup is not None:
            old_fd, write_end, thread = self._wakeup
            self._wakeup = None
            signal.set_wakeup_fd(old_fd)
            write_end.close()  # the thread reads the end of the stream and returns
            thread.join()

    def _acknowledge(self, signum: int) -> None:
        if signum in (signal.SIGINT, signal.SIGTERM):
            self._heard += 1
            line = notice(signum, self._heard, self._multi)
            if line:
                say(line)

    def _listen(self) -> None:
        """Start the thread that reads the signal numbers the interpreter writes to the wakeup
        socket the moment a signal arrives, and acknowledges each stop signal."""
        read_end, write_end = socket.socketpair()
        write_end.setblocking(False)  # set_wakeup_fd's rule: the handler must never block
        try:
            old_fd = signal.set_wakeup_fd(write_end.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):  # not possible here: the handler acknowledges instead
            read_end.close()
            write_end.close()
            return

        def read():
            with read_end:
                while data := read_end.recv(64):
                    for signum in data:
                        self._acknowledge(signum)

        thread = threading.Thread(target=read, name="jaxformer-stop-notice", daemon=True)
        thread.start()
        self._wakeup = (old_fd, write_end, thread)

    def requested(self, step: int) -> bool:
        """Whether to stop after ``step`` (call once per step, with every process).
        Several processes: True at the same step in all of them, once any got SIGTERM or
        SIGINT (``signum`` stays None in a process that got neither)."""
        if self._multi:
            if multihost_utils.reached_preemption_sync_point(step):
                return True
            return False
        return self.signum is not None
