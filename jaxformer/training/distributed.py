"""Several processes as one job: ``jax.distributed.initialize`` from flags or the
environment.

Each process runs the same command; together they see every device of every
process (``jax.devices()``), the mesh spans them all, each process places the
rows of the batch that live on its own devices, and only process 0 writes the
run's records. On CPU the processes talk through gloo.
"""

from __future__ import annotations

import os

import jax

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


def initialize(coordinator=None, num_processes=None, process_id=None) -> bool:
    """``jax.distributed.initialize`` when a multi-process run is asked for (see
    ``settings_from``); call before anything else touches JAX's devices. Returns
    whether it did."""
    kwargs = settings_from(coordinator, num_processes, process_id)
    if kwargs is None:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes; no-op on GPU
    jax.distributed.initialize(**kwargs)
    return True
