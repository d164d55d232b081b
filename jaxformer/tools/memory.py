"""Memory and time of one gradient computation, read from XLA: the figures of
experiments/memory.py, as functions a benchmark can reuse.

Memory comes from ``jax.jit(f).lower(...).compile().memory_analysis()``: XLA's own
plan for the compiled program, without running it (temp = the scratch buffers the
program needs at once, argument = its inputs). Gradient sources compared, all
``(params, batch, key=None) -> (loss, grads)``:

    autodiff       jax.value_and_grad(loss_fn) of the plain model (full attention,
                   no chunking, no recompute)
    manual         manual_grads.value_and_grad of the plain model
    blockwise      manual, blockwise attention only
    lean           manual, blockwise attention + chunked loss + remat "block"
    pallas         manual, the Pallas flash-attention kernel (default_sources: on a GPU or TPU;
                   opt-in on CPU, where the kernel runs in slow interpret mode)
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

import manual_grads
from jaxformer.data.batching import random_batch
from jaxformer.model.config import ModelConfig
from jaxformer.model.params import init_params
from jaxformer.model.transformer import loss_fn
from jaxformer.training.memory_plan import MemoryPlan

SOURCES = ("autodiff", "manual", "blockwise", "lean")  # measured on every backend
ALL_SOURCES = SOURCES + ("pallas",)
LEAN_SOURCES = ("blockwise", "lean", "pallas")  # attention without the (B, H, T, T) probabilities


def default_sources(backend: str | None = None) -> tuple[str, ...]:
    """The sources measured when none are named: pallas too on a GPU or a TPU (``backend``,
    default jax.default_backend()), not on CPU, where its interpret mode is slow."""
    return ALL_SOURCES if (backend or jax.default_backend()) in ("gpu", "tpu") else SOURCES


def parse_sources(text: str) -> tuple[str, ...]:
    """"autodiff,manual,pallas" -> the sources; ValueError naming an unknown one."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in ALL_SOURCES]
    if unknown or not names:
        raise ValueError(f"unknown memory source(s) {', '.join(unknown) or repr(text)}; "
                         f"choose from {', '.join(ALL_SOURCES)}")
    return names


def memory_config(seq_len: int = 1024, d_model: int = 256, n_heads: int = 4, n_layers: int = 2,
                  vocab_size: int = 256, attention_block: int = 128, **overrides) -> ModelConfig:
    """The plain model the figures are measured on (d_ff = 4 * d_model); attention_block is
    the block size the blockwise and lean sources use."""
    return ModelConfig(vocab_size=vocab_size, d_model=d_model, n_heads=n_heads, n_layers=n_layers,
                       d_ff=4 * d_model, max_seq_len=seq_len, attention_block=attention_block,
                       **overrides)


def source_config(config: ModelConfig, source: str, loss_chunk: int) -> ModelConfig:
    """The config a source runs: plain for autodiff and manual, the options for the others."""
    if source == "blockwise":
        return config.replace(attention_impl="blockwise")
    if source == "lean":
        return config.replace(attention_impl="blockwise", loss_chunk=loss_chunk, remat="block")
    if source == "pallas":
        return config.replace(attention_impl="pallas", loss_chunk=0, remat="none")
    return config.replace(attention_impl="full", loss_chunk=0, remat="none")


def grad_fn(config: ModelConfig, source: str, loss_chunk: int) -> Callable:
    """(params, batch, key=None) -> (loss, grads) for ``source`` (see the module docstring)."""
    cfg = source_config(config, source, loss_chunk)
    if source == "autodiff":
        return lambda params, batch, key=None: jax.value_and_grad(loss_fn)(params, batch, cfg, key=key)
    return lambda params, batch, key=None: manual_grads.value_and_grad(params, batch, cfg, key=key)


def abstract_inputs(config: ModelConfig, batch_size: int, seq_len: int, dtype=jnp.float32):
    """ShapeDtypeStructs of params and a batch (no memory is allocated)."""
    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config, dtype=dtype))
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    return params, {"inputs": tokens, "targets": tokens}


def compiled_memory(fn: Callable, *args) -> MemoryPlan:
    """XLA's memory plan for jax.jit(fn) compiled at ``args`` (arrays or ShapeDtypeStructs):
    temp (scratch buffers alive at once), argument (params and batch), output (loss and grads)."""
    return MemoryPlan.of(jax.jit(fn).lower(*args).compile())


def measure_memory(config: ModelConfig, batch_size: int, seq_len: int, loss_chunk: int,
                   sources=SOURCES) -> dict[str, MemoryPlan]:
    """{source: MemoryPlan} of one gradient computation at (batch_size, seq_len)."""
    config = config.replace(max_seq_len=max(config.max_seq_len, seq_len))
    args = abstract_inputs(config, batch_size, seq_len)
    return {s: compiled_memory(grad_fn(config, s, loss_chunk), *args) for s in sources}


def random_inputs(config: ModelConfig, batch_size: int, seq_len: int, seed: int = 0):
    """Real params (init_params, float32) and a random batch (data.random_batch) for timing."""
    params = jax.jit(init_params, static_argnums=(1, 2))(jax.random.PRNGKey(seed), config, jnp.float32)
    return params, jax.device_put(random_batch(config, batch_size, seq_len, seed))


def time_sources(fns: dict[str, Callable], args, rounds: int = 5, warmup: int = 1) -> dict[str, float]:
    """{name: median seconds per call}: the jitted fns run interleaved, one call each per
    round, ``warmup`` rounds (compile included) not counted; block_until_ready on each."""
    jitted = {name: jax.jit(fn) for name, fn in fns.items()}
    times = {name: [] for name in fns}
    for r in range(warmup + rounds):
        for name, fn in jitted.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


class MemoryReport(NamedTuple):
    memory: dict  # {seq_len: {source: MemoryPlan}}
    lean_vs_autodiff: float  # temp(lean) / temp(autodiff) at the base length
    growth: dict  # {source: temp at the long length / temp at the base length}
    step_seconds: dict  # {source: median seconds}, empty when not timed
    lean_vs_manual_time: float | None  # step(lean) / step(manual), None when not timed
    loadavg: tuple  # os.getloadavg() when the timing ended (or at the end of the memory runs)


def memory_report(config: ModelConfig, batch_size: int, seq_len: int, long_seq_len: int,
                  loss_chunk: int, rounds: int = 5, timing: bool = True,
                  sources: tuple[str, ...] | None = None) -> MemoryReport:
    """Every figure of experiments/memory.py, from one run; ``sources`` (default
    default_sources()) must include autodiff, manual and lean. Timing covers manual,
    lean and, when measured, pallas."""
    sources = sources or default_sources()
    missing = [s for s in ("autodiff", "manual", "lean") if s not in sources]
    if missing:
        raise ValueError(f"memory sources must include {', '.join(missing)} (the report's ratios need them)")
    memory = {T: measure_memory(config, batch_size, T, loss_chunk, sources) for T in (seq_len, long_seq_len)}
    base, long = memory[seq_len], memory[long_seq_len]
    growth = {s: long[s].temp / base[s].temp for s in sources}
    steps, ratio = {}, None
    if timing:
        cfg = config.replace(max_seq_len=max(config.max_seq_len, seq_len))
        timed = ("manual", "lean") + (("pallas",) if "pallas" in sources else ())
        fns = {s: grad_fn(cfg, s, loss_chunk) for s in timed}
        steps = time_sources(fns, random_inputs(cfg, batch_size, seq_len), rounds=rounds)
        ratio = steps["lean"] / steps["manual"]
    return MemoryReport(memory, base["lean"].temp / base["autodiff"].temp, growth,
                        steps, ratio, os.getloadavg())


def format_report(report: MemoryReport, seq_len: int, long_seq_len: int) -> str:
    mib = lambda n: f"{n / 2**20:9.1f} MiB"  # noqa: E731
    lines = [f"{'source':<10} {'T':>5} {'temp':>13} {'arguments':>13} {'outputs':>13}"]
    for T, stats in report.memory.items():
        for s, m in stats.items():
            lines.append(f"{s:<10} {T:>5} {mib(m.temp)} {mib(m.argument)} {mib(m.output)}")
    lines.append("")
    lines.append(f"(a) temp, lean manual / autodiff at T={seq_len}: {report.lean_vs_autodiff:.3f}"
                 f"  (target <= 0.25)")
    for s in report.growth:
        lines.append(f"(b) temp growth T={long_seq_len} / T={seq_len}, {s:<9}: {report.growth[s]:.2f}x"
                     + ("  (target <= 2.2)" if s in LEAN_SOURCES else ""))
    if report.step_seconds:
        for s, t in report.step_seconds.items():
            lines.append(f"(c) step, {s:<6}: {1e3 * t:9.1f} ms (median)")
        lines.append(f"(c) step, lean / manual: {report.lean_vs_manual_time:.2f}x  (target <= 1.3)")
    lines.append(f"load average: {' '.join(f'{x:.2f}' for x in report.loadavg)}")
    return "\n".join(lines)
