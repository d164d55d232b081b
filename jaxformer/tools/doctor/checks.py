"""The checks of ``jaxformer doctor``, each on the device JAX runs on (device 0), each
returning ``Check`` rows: passed, failed, or not checked (and why).

- kernels (kernel_checks.py): the attention cores against the full layer's core, forward
  and gradients; on a GPU or a TPU the Pallas kernels compiled, on a GPU cuDNN's too.
- gradients: manual_grads against jax.grad on a small GPT-2-shaped model
  (compare.run_comparison, per-leaf relative error against check.tolerance_for).
- training: TRAIN_STEPS steps of the tiny preset per attention implementation the
  device has (training/step.py's factory, manual gradients; cuDNN has only jax.grad).
- bench: a few rounds of tools/bench/run.py's benchmark, tokens/s and MFU (observe/flops.py).

Relative errors are norm ratios, ``||got - ref|| / ||ref||`` per array
(manual_grads.check.compare_trees). Float32 comparisons run under
``jax.default_matmul_precision("highest")``: XLA's default on a GPU rounds float32
products to TF32 (10-bit mantissa), far coarser than the float32 tolerances here.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.config import ModelConfig, get_preset
from jaxformer.model.params import init_params
from jaxformer.tools.bench import run as bench
from jaxformer.tools.compare import grads as compare
from jaxformer.tools.bench.contestants import error_line
from jaxformer.tools.compare.leaves import error_rank
from jaxformer.training.optim import make_optimizer
from jaxformer.training.step import grad_source, init_state, make_train_step

PASSED, FAILED, NOT_CHECKED = "passed", "failed", "not checked"
NO_CUDNN = "no GPU (cuDNN's fused attention runs only on a GPU)"

TRAIN_STEPS = 20
# Training passes when the last loss is at least 10% below the first: the tiny model on one
# batch goes from 5.54 to 2.46 (-55%) with every implementation; one that does not learn
# (a zero or wrong-signed gradient) stays at or above its first loss.
TRAIN_DROP = 0.1


class Check(NamedTuple):
    group: str  # "kernels", "gradients", "training" or "bench"
    name: str  # what was checked, e.g. "pallas bfloat16 (Triton)"
    status: str  # PASSED, FAILED or NOT_CHECKED
    detail: str  # one line: the measurement against its bound, or why it was not checked
    values: dict | None = None  # the numbers behind ``detail``, for report.json


def judged(group: str, name: str, fn: Callable[[], list[Check]]) -> list[Check]:
    """fn()'s checks; an exception becomes one failed check naming it (never a traceback:
    the other checks still run)."""
    try:
        return fn()
    except Exception as e:  # a kernel that does not build, out of memory, a bad install, ...
        return [Check(group, name, FAILED, f"raised {error_line(e)}")]


def worst(rels: dict) -> tuple[str, float]:
    """(name, rel) of the largest relative error in {name: rel}, NaN ranked worst."""
    name = max(rels, key=lambda n: error_rank(rels[n]))
    return name, rels[name]


# ----------------------------------------------------------------------------
# manual gradients against jax.grad


def gpt2_shaped(platform: str, quick: bool) -> tuple[ModelConfig, int, int]:
    """(config, batch size, sequence length): GPT-2's block (pre-LN, GELU tanh, learned
    positions, the head tied) at two layers; GPT-2's width and vocabulary on an
    accelerator, narrower on a CPU, tiny with ``quick``."""
    if quick:
        return get_preset("gpt2", d_model=32, n_heads=2, n_layers=2, d_ff=128, max_seq_len=16), 2, 16
    if platform == "cpu":
        return get_preset("gpt2", d_model=128, n_heads=4, n_layers=2, d_ff=512, max_seq_len=64,
                          vocab_size=50257), 4, 64
    return get_preset("gpt2", n_layers=2, max_seq_len=256, vocab_size=50257), 4, 256


def shape_text(config: ModelConfig, B: int, T: int) -> str:
    return (f"L{config.n_layers} D{config.d_model} H{config.n_heads} F{config.d_ff} "
            f"V{config.vocab_size}, B{B} T{T}")


def gradient_checks(platform: str, quick: bool, seed: int) -> list[Check]:
    """compare.run_comparison of manual_grads.value_and_grad with jax.grad: float32,
    matmul precision highest, every leaf within check.tolerance_for("float32")."""
    config, B, T = gpt2_shaped(platform, quick)
    name = "manual vs jax.grad, float32"
    with jax.default_matmul_precision("highest"):
        params = init_params(jax.random.PRNGKey(seed), config, jnp.float32)
        batch = compare.make_batch(config, B, T, seed)
        r = compare.run_comparison(config, params, batch, name="gpt2-shaped", repeats=1, seed=seed)
    errors = {row["path"]: row["rel"] for row in r.leaves}
    if not errors:  # the trees differ in structure: compare names the leaves
        return [Check("gradients", name, FAILED, "; ".join(r.failures))]
    at, rel = worst(errors)
    over = [row for row in r.leaves if not row["passed"]]
    detail = (f"worst leaf rel {rel:.1e} ({at}) {'<=' if rel <= r.tolerance else '>'} "
              f"{r.tolerance:.0e} over {len(errors)} leaves; loss rel {r.loss['rel']:.1e}")
    if over:
        names = ", ".join(row["path"] for row in over[:3]) + (", ..." if len(over) > 3 else "")
        detail += f"; {len(over)} of {len(errors)} leaves over ({names})"
    elif not r.passed:
        detail += f"; {r.failures[0]}"
    values = {"rel": errors, "tolerance": r.tolerance, "loss": r.loss, "n_params": r.n_params}
    return [Check("gradients", name, PASSED if r.passed else FAILED, detail, values)]


# ----------------------------------------------------------------------------
# training


def train_impls(platform: str) -> list[tuple[str, str, str | None]]:
    """(attention_impl, gradient source, compute dtype) of each training run here."""
    impls = [("full", "manual", None), ("blockwise", "manual", None), ("pallas", "manual", None)]
    if platform == "gpu":  # cuDNN: jax.grad only (no hand-derived backward), bfloat16 products
        impls.append(("cudnn", "auto", "bfloat16"))
    return impls


def train_config() -> tuple[ModelConfig, int, int]:
    """The tiny preset, blockwise attention in two blocks; its recipe's batch (8 x 16)."""
    return get_preset("tiny", attention_block=8), 8, 16


def train_once(impl: str, grads: str, compute_dtype: str | None, seed: int) -> list[float]:
    """The losses of TRAIN_STEPS steps (adam, lr 1e-2, the tiny preset's recipe) on one
    corpus batch, from make_train_step with grad_source(grads)."""
    config, B, T = train_config()
    config = config.replace(attention_impl=impl, compute_dtype=compute_dtype)
    optimizer = make_optimizer("adam", lr=1e-2)
    step = make_train_step(grad_source(grads, config), optimizer)
    state = init_state(init_params(jax.random.PRNGKey(seed), config, jnp.float32), optimizer, seed)
    batch = compare.make_batch(config, B, T, seed)
    losses = []
    for _ in range(TRAIN_STEPS):
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return [float(x) for x in jax.device_get(losses)]


def training_checks(platform: str, seed: int) -> list[Check]:
    """One check per attention implementation: every loss finite, the last at least
    TRAIN_DROP below the first."""
    out = []
    for impl, grads, dtype in train_impls(platform):
        mode = " (interpret mode)" if impl == "pallas" and platform == "cpu" else ""
        name = f"{impl}{mode}, {grads} grads" + (f", {dtype}" if dtype else "")

        def run(impl=impl, grads=grads, dtype=dtype, name=name):
            losses = train_once(impl, grads, dtype, seed)
            finite = all(math.isfinite(x) for x in losses)
            ok = finite and losses[-1] <= (1 - TRAIN_DROP) * losses[0]
            detail = f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps"
            if not finite:
                first = next(i for i, x in enumerate(losses) if not math.isfinite(x))
                detail += f"; not finite from step {first + 1}"
            elif not ok:
                detail += f"; not {TRAIN_DROP:.0%} below the first"
            return [Check("training", name, PASSED if ok else FAILED, detail, {"losses": losses})]

        out += judged("training", name, run)
    if platform != "gpu":
        out.append(Check("training", "cudnn", NOT_CHECKED, NO_CUDNN))
    return out


# ----------------------------------------------------------------------------
# bench


def bench_settings(platform: str, quick: bool, seed: int) -> bench.Settings:
    """A short benchmark: tiny with ``quick``; loopos on a CPU (full attention, manual and
    jax.grad); on an accelerator GPT-2 small in bfloat16 with the fused attentions."""
    if quick:
        config, B, T, rounds, steps, cpu_matmul, attention = get_preset("tiny"), 2, 8, 1, 1, 256, ("full",)
    elif platform == "cpu":
        config, B, T, rounds, steps, cpu_matmul, attention = get_preset("loopos"), 8, 64, 3, 2, 1024, ("full",)
    else:
        attention = ("pallas", "cudnn") if platform == "gpu" else ("pallas",)
        config, B, T, rounds, steps, cpu_matmul = get_preset("gpt2", compute_dtype="bfloat16"), 8, 1024, 3, 5, 1024
    return bench.Settings(config=config, batch_size=B, seq_len=T, rounds=rounds, steps=steps, warmup=1,
                          depths=None, torch=False, torch_compile=False, cpu_matmul=cpu_matmul,
                          torch_threads=None, seed=seed, attention=attention)


def bench_checks(s: bench.Settings, say) -> tuple[list[Check], dict]:
    """bench.run of ``s``: (one check per contestant asked for, passed when it ran (its
    ms/step, tokens/s and MFU reported), failed when it could not build or run; the peak
    FLOP/s the MFU divides by, with its source)."""
    report = bench.run(s, say)
    out = []
    for name, r in report["contestants"].items():
        if r["status"] == "ran":
            mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
            detail = (f"{r['ms_per_step']['median']:.1f} ms/step, {r['tokens_per_s']['median']:,.0f} "
                      f"tokens/s, MFU {mfu}, compile {r['compile_s']:.1f} s")
            values = {k: r[k] for k in ("ms_per_step", "tokens_per_s", "model_flops_per_s", "mfu", "compile_s")}
            out.append(Check("bench", name, PASSED, detail, values))
        elif r.get("error"):
            out.append(Check("bench", name, FAILED, r["error"]))
    return out, report["peak"]
