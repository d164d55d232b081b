"""Memory checked before the first step: XLA's plan for the compiled train step
against the memory the device has.

``check_memory`` lowers and compiles the step for the run's shapes (the compile the
first step would do anyway: jit reuses it), reads its ``MemoryPlan`` (memory_plan.py:
arguments + outputs - the donated buffers they share + temporaries + code) and compares
it with what the device has free: on CPU the host's available RAM (MemAvailable in
/proc/meminfo), shared by all local CPU devices; on GPU ``device.memory_stats()``
(bytes_limit - bytes_in_use). The check runs before the train state is created, so
the plan's arguments (the state and the batch) are all still to be allocated. On a
host the process holds more than the step's plan (the runtime, the compiled code,
the data, the allocator's slack): the step must fit with HOST_MARGIN of the plan and
HOST_SLACK to spare. Measured on a 2-core, 24 GiB CPU: gpt2 in bfloat16, batch 8,
T 512, plan 9.1 GiB, peak RSS 10.0 GiB; at T 1024 the plan of 22.2 GiB passed against
22.5 GiB available without the margin, and the process was killed for memory.

When the plan does not fit, a MemoryCheckError names the need, what there is, and
the options that cut it with the figure each would give: the lean memory options
(compiled, an exact plan) and half the batch with twice the accumulation (estimated
from the one compile: the temporaries scale with the batch).
"""

from __future__ import annotations

import os
import time
from typing import Callable

import jax
import numpy as np

from jaxformer.model.config import ModelConfig
from jaxformer.observe.words import format_bytes
from jaxformer.training.memory_plan import MemoryPlan
from jaxformer.training.step import StepSpec, compiled_step, init_fn

# the lean memory options and the values they take when the run has them off
LEAN = {"attention_impl": "blockwise", "loss_chunk": 256, "remat": "block"}
HOST_MARGIN = 0.15  # of the plan, on a host (see the module docstring)
HOST_SLACK = 512 * 2**20


class MemoryCheckError(ValueError):
    """The compiled train step needs more memory than the device has free."""


def host_available_bytes() -> int:
    """The host's available RAM: MemAvailable of /proc/meminfo, else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available(device) -> tuple[int, str] | None:
    """(free bytes for one device's step, where the figure comes from); None when the
    device does not say."""
    if device.platform == "cpu":
        n = max(1, sum(d.platform == "cpu" for d in jax.local_devices()))
        where = "available host RAM (MemAvailable)" + (f" over {n} CPU devices" if n > 1 else "")
        return host_available_bytes() // n, where
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return stats["bytes_limit"] - stats.get("bytes_in_use", 0), f"free {device.platform} memory"


def needed(total: int, device) -> int:
    """The bytes a step whose plan is ``total`` needs free on ``device``: the plan on an
    accelerator; on a host the plan plus HOST_MARGIN of it and HOST_SLACK."""
    if device.platform == "cpu":
        return int(total * (1 + HOST_MARGIN)) + HOST_SLACK
    return total


def lean_changes(config: ModelConfig) -> dict:
    """The lean memory options the config has off, with the values they would take."""
    off = {"attention_impl": config.attention_impl == "full", "loss_chunk": config.loss_chunk == 0,
           "remat": config.remat == "none"}
    return {k: v for k, v in LEAN.items() if off[k]}


def flags_text(changes: dict) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in changes.items())


def check_memory(compile_plan: Callable[[ModelConfig], MemoryPlan], config: ModelConfig,
                 batch_size: int, accum_steps: int, device, log=None) -> MemoryPlan:
    """Compile the step (``compile_plan(config)`` -> its MemoryPlan) and raise
    MemoryCheckError when it does not fit the device's free memory; returns the plan."""
    plan = compile_plan(config)
    free = available(device)
    if plan is None or free is None or needed(plan.total, device) <= free[0]:
        return plan
    have, where = free
    host = (f"; with {HOST_MARGIN:.0%} and {format_bytes(HOST_SLACK)} to spare for the rest of "
            f"the process: {format_bytes(needed(plan.total, device))}") if device.platform == "cpu" else ""
    lines = [f"the train step needs {format_bytes(plan.total)} per device (XLA's plan: "
             f"{format_bytes(plan.argument)} arguments, {format_bytes(plan.output - plan.alias)} "
             f"new outputs, {format_bytes(plan.temp)} temporaries{host}) and {format_bytes(have)} is "
             f"{where}; options that cut it (XLA's plan):"]
    changes = lean_changes(config)
    lean = None
    if changes:
        if log:
            log(f"the step does not fit; compiling it with {flags_text(changes)} to measure...")
        lean = compile_plan(config.replace(**changes))
        lines.append(f"{flags_text(changes)}: {format_bytes(lean.total)} (compiled);")
    if batch_size % 2 == 0:
        half = f"--batch-size {batch_size // 2} --accum-steps {2 * accum_steps}"
        lines.append(f"{half} (the same tokens per update): {format_bytes(plan.half_batch())} "
                     f"(estimated: half the temporaries);")
        if lean is not None:
            lines.append(f"both: {format_bytes(lean.half_batch())} (estimated);")
    lines.append("--ignore-memory-check tries anyway")
    raise MemoryCheckError(" ".join(lines))


def batch_shapes(batch: dict) -> dict:
    """jax.ShapeDtypeStruct of each array of a host batch."""
    return {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for k, v in batch.items()}


def step_planner(spec: StepSpec, batch: dict, compiled: dict) -> Callable[[ModelConfig], MemoryPlan]:
    """``config -> MemoryPlan`` of the train step ``spec`` with its config replaced
    (step.compiled_step), for the state of ``config`` and the shapes of the host
    ``batch``; each executable is kept in ``compiled`` under its config (the loop runs
    it: no second compile)."""
    shapes = batch_shapes(batch)

    def compile_plan(config: ModelConfig) -> MemoryPlan:
        variant = spec.replace(config=config)
        state = jax.eval_shape(init_fn(variant), 0)
        compiled[config] = compiled_step(variant).lower(state, shapes).compile()
        return MemoryPlan.of(compiled[config])

    return compile_plan


def check_run_memory(spec: StepSpec, settings, batch: dict, device, log=None):
    """The loop's check: say that the step compiles, compile it, and check its plan
    (check_memory) for ``settings``' batch size and accumulation; logs the compile
    time and the plan against the free memory. Returns the compiled step (call it as
    ``step(state, batch)``)."""
    if log:
        log("compiling the train step for this shape...")
    t0 = time.perf_counter()
    compiled: dict = {}
    planner = step_planner(spec, batch, compiled)
    plan = check_memory(planner, spec.config, settings.batch_size, settings.accum_steps, device, log)
    if log:
        free = available(device)
        there = f" of {format_bytes(free[0])} {free[1]}" if free else ""
        need = f"{format_bytes(plan.total)} per device" if plan else "an unknown amount (no memory plan)"
        log(f"compiled in {time.perf_counter() - t0:.1f} s; the step needs {need}{there}")
    return compiled[spec.config]
