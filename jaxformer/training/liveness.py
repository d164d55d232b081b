"""A lost process: the others stop within a bounded time, with one line.

Every process of a ``jax.distributed`` job sends heartbeats to the coordination
service (hosted by process 0); a process silent for ``heartbeat_timeout`` seconds
counts as lost. ``distributed.initialize`` turns on JAX's recoverable mode
(``jax_enable_recoverability``), so the service reports the loss instead of
aborting every other process natively, and starts ``watch``: a daemon thread that
asks the service for the live processes once a second and, when one is missing,
gives ``on_lost`` the lost process ids (the default prints one line and ends the
process with EXIT_LOST). A step that fails because a peer vanished (gloo: "Connection
closed by peer") waits in ``settle`` for that verdict instead of reporting the
collective's own error.

So a lost process stops the others within heartbeat_timeout + about 2 s (a step
blocked in a collective included). The one case JAX 0.10 leaves native: when process
0 itself is lost, the coordination service goes with it and JAX's client ends every
other process at once with its own fatal error and stack dump
(``jax.distributed.initialize`` exposes no callback for it); only when that has not
happened first does the watch report process 0 lost (the service unreachable).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Callable

import jax
from jax._src import distributed as jax_distributed  # the client, as orbax reads it

EXIT_LOST = 75  # EX_TEMPFAIL: the job can continue with --resume
POLL_S = 1.0
# finish(): process 0 stays this long after the others have disconnected. The service
# counts a process gone while it still answers that process's ShutdownTask call; had
# process 0 exited then, the other is aborted natively ("Failed to disconnect from
# coordination service", SIGABRT), seen with two jobs on a busy machine.
DISCONNECT_GRACE_S = 1.0

_lost = threading.Event()
_done = threading.Event()  # the job is ending normally: the watch stands down


def lost_line(ids: list[int], num_processes: int, heartbeat_timeout: int) -> str:
    who = ", ".join(map(str, ids))
    return (f"error: lost process {who} of {num_processes} (no heartbeat for {heartbeat_timeout} s, "
            f"or it exited); this process stops too")


def _report_and_exit(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_LOST)  # at once: collectives and barriers with the lost process would hang


def missing(client, num_processes: int) -> list[int]:
    """The processes the coordination service no longer counts as live ([] when all are)."""
    live = client.get_live_nodes(list(range(num_processes)))
    return sorted(set(range(num_processes)) - set(live))


def watch(num_processes: int, heartbeat_timeout: int,
          on_lost: Callable[[list[int]], None] | None = None,
          what_next: Callable[[], str] | None = None) -> threading.Thread:
    """Start the daemon thread that watches the job's processes (see the module
    docstring). ``what_next``: text appended to the default line (e.g. the resume
    command)."""
    client = jax_distributed.global_state.client

    def default(ids: list[int]) -> None:
        line = lost_line(ids, num_processes, heartbeat_timeout)
        _report_and_exit(f"{line}; {what_next()}" if what_next else line)

    def loop() -> None:
        while True:
            try:
                ids = missing(client, num_processes)
            except Exception:  # noqa: BLE001 - the coordination service (process 0) is unreachable
                if _done.wait(0.5):  # or this process is disconnecting at the end
                    return
                ids = [0]
            if ids:
                # a normal end disconnects the others right after a barrier: give this
                # process's own finish() a moment to say so
                _done.wait(0.5)
            if _done.is_set():
                return
            if ids:
                _lost.set()
                (on_lost or default)(ids)
                return
            time.sleep(POLL_S)

    atexit.register(_done.set)  # runs before JAX's own shutdown (registered earlier)
    thread = threading.Thread(target=loop, name="jaxformer-liveness", daemon=True)
    thread.start()
    return thread


def finish(num_processes: int, timeout: float) -> None:
    """End a multi-process job in order, once every process has called this after a
    barrier: the watch stands down, every process but 0 disconnects from the coordination
    service, and process 0 (which hosts it) waits up to ``timeout`` seconds for them to
    be gone before it may exit. (In recoverable mode JAX's own shutdown does not wait,
    and a process still connected when process 0 exits is ended natively.)"""
    _done.set()
    if jax.process_index() != 0:
        jax.distributed.shutdown()
        return
    client = jax_distributed.global_state.client
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if len(missing(client, num_processes)) == num_processes - 1:
                time.sleep(DISCONNECT_GRACE_S)
                return
        except Exception:  # noqa: BLE001 - nothing left to wait for
            return
        time.sleep(0.1)


STATUS_CODES = ("UNKNOWN", "UNAVAILABLE", "INTERNAL", "ABORTED", "DEADLINE_EXCEEDED", "CANCELLED")


def may_be_a_lost_peer(e: BaseException) -> bool:
    """Whether ``e`` can come from a collective or barrier whose peer vanished: a JAX
    runtime error, or an error whose message starts with a runtime status code; or an
    error caused by one (a checkpoint save whose all-gather lost its peer)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, jax.errors.JaxRuntimeError) or str(e).split(":", 1)[0] in STATUS_CODES:
            return True
        e = e.__cause__ or e.__context__
    return False


def settle(heartbeat_timeout: int) -> None:
    """After an error in a multi-process run: wait until the watcher has decided whether a
    process was lost (it then ends this process), at most heartbeat_timeout + 2 polls."""
    _lost.wait(heartbeat_timeout + 2 * POLL_S)
    if _lost.is_set():  # the watcher is reporting and exiting
        time.sleep(10)
