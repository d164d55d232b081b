"""Training-step benchmark: manual vs automatic gradients over each attention
implementation vs PyTorch (eager, compiled), on the device JAX sees.

    jaxformer bench --preset loopos                       # or: python experiments/benchmark.py
    jaxformer bench --preset gpt2 --compute-dtype bfloat16 --batch-size 16 --seq-len 1024

``bench_select`` chooses the contestants this device can run (manual: full,
blockwise, pallas; jax.grad: full, cudnn; PyTorch eager and torch.compile with SDPA)
and says why each other one is skipped. Every contestant (``bench_contestants``) runs
the same model (one set of initial weights, copied into PyTorch), the same batch and
AdamW with the same settings. After
warm-up steps (compilation included, timed apart), rounds run the contestants in turn
(A B C A B C ...) so machine drift hits all of them alike; each round times
``steps`` steps between two ``block_until_ready``. Reported per contestant:
median ms/step and tokens/s with min-max over rounds, model FLOP/s and MFU
(``observe.flops``; a mixture of experts counts its active parameters, the k chosen
experts', so its MFU is the active-parameter MFU) against the device's peak in the matmul
dtype, compile time, and
for JAX XLA's memory analysis of the compiled step; for the full-attention gradient
functions, compile time at two depths (beyond manual_grads.remat.UNROLL_MAX_LAYERS
layers the blocks run under lax.scan on a CPU and a TPU, so it should not grow with depth
there; a GPU's manual step runs them unrolled, and its compile time grows with depth). ``run(settings)`` returns the report dict that
``bench_report`` writes as report.json, report.md and bench.png; the command line is
``jaxformer.cli.bench``.
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.kernels.pallas import timing as pallas_timing
from jaxformer.kernels.pallas import tune as pallas_tune
from jaxformer.data.batching import random_batch
from jaxformer.model.config import ModelConfig
from jaxformer.model.params import count_params, init_params
from jaxformer.observe import flops
from jaxformer.tools.bench.contestants import (OPTIMIZER, make_contestants, memory_stats,
                                               time_rounds, torch_version)
from jaxformer.tools.bench.select import ALL_NAMES, TORCH_KINDS, Skip, Spec, select, torch_device
from jaxformer.training.step import grad_source

# Where work on the manual step should get to, at the loopos shape (reported, never
# enforced); at larger shapes the goal is >= 1.2x PyTorch eager.
TARGETS = {"manual_over_auto_step_time": ("<=", 0.6),
           "manual_over_torch_eager_tokens_per_s": (">=", 1.0),
           "manual_over_torch_compile_tokens_per_s": (">=", 1.0)}


MOE_TORCH = "the PyTorch reference model has no mixture-of-experts layer (n_experts > 0)"


class Settings(NamedTuple):
    config: ModelConfig
    batch_size: int
    seq_len: int
    rounds: int
    steps: int
    warmup: int
    depths: tuple | None  # (L1, L2): n_layers of the compile-time-vs-depth check; None: no check
    torch: bool
    torch_compile: bool
    cpu_matmul: int  # n of the n x n matmul that measures a CPU's peak
    torch_threads: int | None  # torch.set_num_threads, None: torch's default
    seed: int
    attention: tuple | None = None  # attention impls to run; None: bench_select's default here
    torch_compile_off: str = "--no-torch-compile"  # why torch_compile is False, for its skip line
    tune: bool = True  # on a GPU, tune the Pallas launch first (False: the table's entry, else default tiles)


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


def grad_fn_analysis(s: Settings, kinds=("manual", "auto")) -> dict:
    """Per gradient source of full attention: compile time and memory at the benchmark's
    shape, and compile time at each of s.depths layers."""
    out = {}
    for kind in kinds:
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
    if samples("manual_full") and samples("auto_full"):
        out["manual_over_auto_step_time"] = paired("manual_full", "auto_full")
    for name in TORCH_KINDS:
        if samples("manual_full") and samples(name):  # tokens/s ratio = inverse step-time ratio
            out[f"manual_over_{name}_tokens_per_s"] = paired(name, "manual_full")
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


def fastest(results: dict) -> str | None:
    """The contestant with the highest median tokens/s (None when none ran)."""
    ran = {n: r["tokens_per_s"]["median"] for n, r in results.items() if r.get("tokens_per_s")}
    return max(ran, key=ran.get) if ran else None


def choose(s: Settings) -> tuple[list[Spec], list[Skip], str | None]:
    """(the contestants to run on the backend JAX runs on, the skipped ones, the torch
    device or None)."""
    backend = jax.default_backend()
    device, torch_problem = torch_device(backend) if s.torch else (None, None)
    if s.torch and s.config.n_experts:
        device, torch_problem = None, MOE_TORCH
    specs, skipped = select(s.attention, backend, s.config.compute_dtype, torch_device=device,
                            torch_problem=torch_problem, with_torch=s.torch,
                            with_torch_compile=s.torch_compile, torch_compile_off=s.torch_compile_off)
    return specs, skipped, device


def pallas_shape(config: ModelConfig, seq_len: int) -> pallas_tune.Shape:
    """The launch-table shape the Pallas kernels of ``config``'s attention trace at length
    ``seq_len``: head width, the products' dtype (compute_dtype, else the params' float32),
    causal, query heads per key/value head."""
    return pallas_tune.Shape(seq_len, config.d_head, config.compute_dtype or "float32", config.causal,
                             config.n_heads // config.kv_heads)


def tune_pallas(config: ModelConfig, seq_len: int, say) -> None:
    """On a GPU, the Pallas kernels' launch at this shape tuned (timed once and written to
    the launch table, or read from it) before the pallas step is compiled and timed;
    pallas_block_q / pallas_block_k set in the config need no tuning."""
    if pallas_tune.device_kind() is None or config.pallas_block_q or config.pallas_block_k:
        return
    shape = pallas_shape(config, seq_len)
    picked = pallas_timing.tune([shape])[shape]
    say(f"pallas launch for T={shape.T} Dh={shape.Dh} {shape.dtype}: {picked} ({pallas_tune.cache_path()})")


def say_skips(skipped: list[Skip], say) -> None:
    """One line per reason: contestants skipped for the same reason share it."""
    by_reason: dict[str, list[str]] = {}
    for s in skipped:
        by_reason.setdefault(s.reason, []).append(s.name)
    for reason, names in by_reason.items():
        say(f"{', '.join(names)}: skipped: {reason}")


def run(s: Settings, say=lambda line: print(line, file=sys.stderr, flush=True)) -> dict:
    """Run the benchmark of ``s``; returns the report dict (see bench_report). ``say``
    hears one line per contestant skipped (or per shared reason) and per failure."""
    load_before = os.getloadavg()
    config, B, T = s.config, s.batch_size, s.seq_len
    specs, skipped, device = choose(s)
    say_skips(skipped, say)
    if s.tune and any(spec.attention == "pallas" for spec in specs):
        tune_pallas(config, T, say)
    params = init_params(jax.random.PRNGKey(s.seed), config, dtype=jnp.float32)
    batch = random_batch(config, B, T, s.seed)
    per_token = flops.flops_per_token(config, T)
    dtype = flops.matmul_dtype(config, "float32")
    contestants = make_contestants(specs, config, params, batch, torch_device=device,
                                   torch_threads=s.torch_threads, say=say)
    peak, peak_source = flops.device_peak(dtype=dtype, cpu_matmul=s.cpu_matmul)
    probe = None
    if jax.devices()[0].platform == "cpu":  # the CPU's peak is measured in every round too
        probe = lambda: flops.cpu_matmul_flops(s.cpu_matmul)  # noqa: E731
    samples, probes, failed = time_rounds(contestants, s.rounds, s.steps, s.warmup, probe, say)
    probes = [p for p in probes if flops.plausible_cpu_peak(p)]
    if probes:
        peak = max([p for p in (peak, *probes) if p])
        peak_source = (f"measured: best float32 {s.cpu_matmul}x{s.cpu_matmul} matmul of "
                       f"{len(probes) + 1} measurements, one after each round")
    results = {}
    for c in contestants:
        error = c.error or failed.get(c.name)
        entry = {"status": "skipped" if error else "ran", "reason": error, "grads": c.spec.grads,
                 "attention": c.spec.attention, "compile_s": c.compile_s, "error": error,
                 "memory": c.memory}
        if c.name in samples:
            entry.update(_summary(samples[c.name], B * T, per_token, peak))
        results[c.name] = entry
    for skip in skipped:
        results[skip.name] = {"status": "skipped", "reason": skip.reason, "error": None}
    results = {n: results[n] for n in ALL_NAMES if n in results}
    ran_full = [k for k in ("manual", "auto") if results.get(f"{k}_full", {}).get("status") == "ran"]
    analysis = grad_fn_analysis(s, ran_full) if s.depths else {}
    ratios = _ratios(results)
    return {
        "command": shlex.join(sys.argv),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {**machine(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "shape": {"config": config.to_dict(), "batch_size": B, "seq_len": T, "tokens_per_step": B * T,
                  "params": count_params(params)},
        "settings": {"rounds": s.rounds, "steps_per_round": s.steps, "warmup_steps": s.warmup,
                     "optimizer": OPTIMIZER, "param_dtype": "float32", "matmul_dtype": dtype,
                     "attention": list(s.attention) if s.attention else None,
                     "torch_device": device,
                     "torch_autocast": config.compute_dtype if device and config.compute_dtype in
                     ("bfloat16", "float16") else None},
        "flops": flops.flops_breakdown(config, T),
        "peak": {"flops_per_s": peak, "source": peak_source, "dtype": dtype,
                 "cpu_samples": probes},
        "contestants": results,
        "fastest": fastest(results),
        "grad_fns": analysis,
        "ratios": ratios,
        "targets": _targets(ratios),
        "notes": [f"{sk.name} skipped: {sk.reason}" for sk in skipped],
    }
