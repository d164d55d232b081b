"""Several processes as one job: ``jax.distributed.initialize`` from flags or the
environment.

Each process runs the same command; together they see every device of every
process (``jax.devices()``), the mesh spans them all, each process places the
rows of the batch that live on its own devices, and only process 0 writes the
run's records. On CPU the processes talk through gloo.

A process silent for ``heartbeat_timeout`` seconds (default HEARTBEAT_TIMEOUT_S,
``--heartbeat-timeout`` or JAXFORMER_HEARTBEAT_TIMEOUT) counts as lost; the others
then stop with one line (liveness.py).
"""

from __future__ import annotations

import os

import jax

from jaxformer.training import liveness

HEARTBEAT_TIMEOUT_S = 30  # JAX's default is 100; a lost process should not hold the others longer
HEARTBEAT_ENV = "JAXFORMER_HEARTBEAT_TIMEOUT"

ENV = {  # setting -> environment variable
    "coordinator": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


def _int(name: str, value) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    return number


def settings_from(coordinator=None, num_processes=None, process_id=None) -> dict | None:
    """The coordinator, process count and process id from the arguments, else from
    JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID; None when none is
    set (a single-process run). A partial set is a ValueError naming what is missing."""
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    for name, var in ENV.items():
        if given[name] is None and os.environ.get(var):
            given[name] = os.environ[var]
    if all(v is None for v in given.values()):
        return None
    missing = [f"{name} (--{name.replace('_', '-')} or {ENV[name]})"
               for name, v in given.items() if v is None]
    if missing:
        raise ValueError(f"a multi-process run needs all of coordinator, num_processes and "
                         f"process_id; missing: {', '.join(missing)}")
    n = _int("num_processes", given["num_processes"])
    i = _int("process_id", given["process_id"])
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"process_id must be in [0, num_processes={n}), got {i}")
    return {"coordinator_address": str(given["coordinator"]), "num_processes": n, "process_id": i}


def heartbeat_timeout_from(value=None) -> int:
    """The heartbeat timeout in seconds: ``value``, else JAXFORMER_HEARTBEAT_TIMEOUT, else
    HEARTBEAT_TIMEOUT_S; a ValueError names a bad one."""
    if value is None:
        value = os.environ.get(HEARTBEAT_ENV) or HEARTBEAT_TIMEOUT_S
    seconds = _int(f"heartbeat timeout (--heartbeat-timeout or {HEARTBEAT_ENV})", value)
    if seconds < 1:
        raise ValueError(f"the heartbeat timeout must be at least 1 second, got {seconds}")
    return seconds


def initialize(coordinator=None, num_processes=None, process_id=None, heartbeat_timeout=None,
               what_next=None) -> int | None:
    """``jax.distributed.initialize`` when a multi-process run is asked for (see
    ``settings_from``); call before anything else touches JAX's devices. Starts the
    watch for lost processes (liveness.watch; ``what_next()``: text for its line).
    Returns the heartbeat timeout in seconds, None for a single-process run."""
    kwargs = settings_from(coordinator, num_processes, process_id)
    if kwargs is None:
        return None
    seconds = heartbeat_timeout_from(heartbeat_timeout)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes; no-op on GPU
    # a lost process is reported to the others instead of ending them natively
    jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(**kwargs, heartbeat_timeout_seconds=seconds)
    liveness.watch(kwargs["num_processes"], seconds, what_next=what_next)
    return seconds
