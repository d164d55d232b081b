"""Training-step benchmark: manual vs automatic gradients vs PyTorch (eager, compiled).

    jaxformer bench --preset loopos                       # or: python experiments/benchmark.py
    jaxformer bench --preset loopos --d-model 512 --n-layers 6 --d-ff 2048 \\
        --max-seq-len 256 --batch-size 8 --seq-len 256

Every contestant (``bench_contestants``) runs the same model (one set of initial
weights, copied into PyTorch), the same batch and AdamW with the same settings. After
warm-up steps (compilation included, timed apart), rounds run the contestants in turn
(A B C A B C ...) so machine drift hits all of them alike; each round times
``steps`` steps between two ``block_until_ready``. Reported per contestant:
median ms/step and tokens/s with min-max over rounds, model FLOP/s and MFU
(``observe.flops``), compile time; per JAX gradient function: XLA's memory
analysis and compile time, also at two depths (the blocks run under lax.scan,
so it should not grow with depth). ``run(settings)`` returns the report dict that
``bench_report`` writes as report.json, report.md and bench.png; the command line is
``jaxformer.cli.bench``.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.config import ModelConfig
from jaxformer.model.params import count_params, init_params
from jaxformer.observe import flops
from jaxformer.tools.bench_contestants import (JAX_KINDS, OPTIMIZER, TORCH_KINDS, make_batch,
                                               make_contestants, time_rounds, torch_version)
from jaxformer.training.step import grad_source

# Where work on the manual step should get to, at the loopos shape (reported, never
# enforced); at larger shapes the goal is >= 1.2x PyTorch eager.
TARGETS = {"manual_over_auto_step_time": ("<=", 0.6),
           "manual_over_torch_eager_tokens_per_s": (">=", 1.0),
           "manual_over_torch_compile_tokens_per_s": (">=", 1.0)}


class Settings(NamedTuple):
    config: ModelConfig
    batch_size: int
    seq_len: int
    rounds: int
    steps: int
    warmup: int
    depths: tuple  # (L1, L2): n_layers of the compile-time-vs-depth check
    torch: bool
    torch_compile: bool
    cpu_matmul: int  # n of the n x n matmul that measures a CPU's peak
    torch_threads: int | None  # torch.set_num_threads, None: torch's default
    seed: int


# ----------------------------------------------------------------------------
# XLA's view of each gradient function: memory and compile time


def _shapes(config, batch_size, seq_len, dtype=jnp.float32):
    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config, dtype=dtype))
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    return params, {"inputs": tokens, "targets": tokens}


def compile_grad_fn(kind: str, config, batch_size: int, seq_len: int):
    """(seconds to trace, lower and compile the jitted gradient function, the compiled)."""
    params, batch = _shapes(config, batch_size, seq_len)
    t0 = time.perf_counter()
    compiled = jax.jit(grad_source(kind, config)).lower(params, batch).compile()
    return time.perf_counter() - t0, compiled


def memory_stats(compiled) -> dict | None:
    """XLA's memory_analysis of a compiled function, in bytes (None if unavailable)."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # not implemented on this backend
        return None
    if m is None:
        return None
    names = ("temp", "argument", "output", "alias", "generated_code")
    return {f"{n}_bytes": int(getattr(m, f"{n}_size_in_bytes", 0) or 0) for n in names}


def grad_fn_analysis(s: Settings) -> dict:
    """Per JAX gradient function: compile time and memory at the benchmark's shape, and
    compile time at each of s.depths layers."""
    out = {}
    for kind in JAX_KINDS:
        seconds, compiled = compile_grad_fn(kind, s.config, s.batch_size, s.seq_len)
        depth = {str(L): seconds if L == s.config.n_layers else  # the same program: not twice
                 compile_grad_fn(kind, s.config.replace(n_layers=L), s.batch_size, s.seq_len)[0]
                 for L in s.depths}
        out[kind] = {"compile_s": seconds, "memory": memory_stats(compiled),
                     "compile_s_by_depth": depth}
    return out


# ----------------------------------------------------------------------------
# the whole benchmark


def _summary(ms: list[float], tokens_per_step: int, flops_per_token: int, peak: float | None) -> dict:
    tok = [tokens_per_step / (m / 1e3) for m in ms]
    med_tok = tokens_per_step / (statistics.median(ms) / 1e3)
    achieved = med_tok * flops_per_token
    return {
        "ms_per_step": {"median": statistics.median(ms), "min": min(ms), "max": max(ms)},
        "tokens_per_s": {"median": med_tok, "min": min(tok), "max": max(tok)},
        "samples_ms": ms,
        "model_flops_per_s": achieved,
        "mfu": achieved / peak if peak else None,
    }


def _ratios(results: dict) -> dict:
    """Paired ratios: each round's step times of two contestants divided (they ran side by
    side, so machine drift cancels), then the median over rounds; also min and max."""
    def samples(name):
        r = results.get(name) or {}
        return r.get("samples_ms")

    def paired(num, den):  # median over rounds of samples[num][r] / samples[den][r]
        a, b = samples(num), samples(den)
        r = [x / y for x, y in zip(a, b)]
        return {"median": statistics.median(r), "min": min(r), "max": max(r)}

    out = {}
    if samples("manual") and samples("auto"):
        out["manual_over_auto_step_time"] = paired("manual", "auto")
    for name in TORCH_KINDS:
        if samples("manual") and samples(name):  # tokens/s ratio = inverse step-time ratio
            out[f"manual_over_{name}_tokens_per_s"] = paired(name, "manual")
    return out


def _targets(ratios: dict) -> dict:
    out = {}
    for key, (op, bound) in TARGETS.items():
        if key in ratios:
            value = ratios[key]["median"]
            out[key] = {"bound": f"{op} {bound}", "value": value,
                        "met": value <= bound if op == "<=" else value >= bound}
    return out


def machine() -> dict:
    dev = jax.devices()[0]
    info = {"platform": dev.platform, "device_kind": getattr(dev, "device_kind", ""),
            "device_count": jax.device_count(), "cpu_count": os.cpu_count(),
            "machine": platform.machine(), "python": platform.python_version(),
            "jax": jax.__version__, "torch": torch_version()}
    if info["torch"]:
        import torch

        info["torch_threads"] = torch.get_num_threads()
    return info


def run(s: Settings) -> dict:
    """Run the benchmark of ``s``; returns the report dict (see bench_report)."""
    load_before = os.getloadavg()
    config, B, T = s.config, s.batch_size, s.seq_len
    params = init_params(jax.random.PRNGKey(s.seed), config, dtype=jnp.float32)
    batch = make_batch(config, B, T, s.seed)
    per_token = flops.flops_per_token(config, T)
    dtype = flops.matmul_dtype(config, "float32")
    contestants, notes = make_contestants(config, params, batch, with_torch=s.torch,
                                          with_torch_compile=s.torch_compile,
                                          torch_threads=s.torch_threads)
    peak, peak_source = flops.device_peak(dtype=dtype, cpu_matmul=s.cpu_matmul)
    probe = None
    if jax.devices()[0].platform == "cpu":  # the CPU's peak is measured in every round too
        probe = lambda: flops.cpu_matmul_flops(s.cpu_matmul)
    samples, probes = time_rounds(contestants, s.rounds, s.steps, s.warmup, probe)
    if probes:
        peak = max([peak, *probes])
        peak_source = (f"measured: best float32 {s.cpu_matmul}x{s.cpu_matmul} matmul of "
                       f"{len(probes) + 1} measurements, one after each round")
    results = {}
    for c in contestants:
        entry = {"compile_s": c.compile_s, "error": c.error}
        if c.name in samples:
            entry.update(_summary(samples[c.name], B * T, per_token, peak))
        results[c.name] = entry
    analysis = grad_fn_analysis(s)
    ratios = _ratios(results)
    return {
        "command": " ".join(sys.argv),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {**machine(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "shape": {"config": config.to_dict(), "batch_size": B, "seq_len": T, "tokens_per_step": B * T,
                  "params": count_params(params)},
        "settings": {"rounds": s.rounds, "steps_per_round": s.steps, "warmup_steps": s.warmup,
                     "optimizer": OPTIMIZER, "param_dtype": "float32", "matmul_dtype": dtype},
        "flops": flops.flops_breakdown(config, T),
        "peak": {"flops_per_s": peak, "source": peak_source, "dtype": dtype,
                 "cpu_samples": probes},
        "contestants": results,
        "grad_fns": analysis,
        "ratios": ratios,
        "targets": _targets(ratios),
        "notes": notes,
    }
