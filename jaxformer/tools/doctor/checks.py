"""The checks of ``jaxformer doctor``, each on the device JAX runs on (device 0), each
returning ``Check`` rows: passed, failed, or not checked (and why).

- kernels (kernel_checks.py): the attention cores against the full layer's core, forward
  and gradients; on a GPU or a TPU the Pallas kernels compiled, on a GPU cuDNN's too.
- gradients: manual_grads against jax.grad on a small GPT-2-shaped model, the params
  drawn and both gradients taken in one program (compare.judge: per-leaf relative error
  against check.tolerance_for).
- training: TRAIN_STEPS steps of the tiny preset per attention implementation the
  device has (training/step.py's factory, manual gradients; cuDNN's with bfloat16 products),
  from the same params.
- bench: a few rounds of tools/bench/run.py's benchmark, tokens/s and MFU (observe/flops.py).

Relative errors are norm ratios, ``||got - ref|| / ||ref||`` per array
(manual_grads.check.compare_trees). Float32 comparisons run under
``jax.default_matmul_precision("highest")``: XLA's default on a GPU rounds float32
products to TF32 (10-bit mantissa), far coarser than the float32 tolerances here.

Nearly all of the doctor's time is XLA compiling, so the checks compile few programs, and
compile them for their values (``compile_check``: CHECK_COMPILE_OPTIONS), not for speed.
"""

from __future__ import annotations

import concurrent.futures
import math
import re
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.config import ModelConfig, get_preset
from jaxformer.model.params import count_params, init_params
from jaxformer.tools.bench import run as bench
from jaxformer.tools.compare import grads as compare
from jaxformer.tools.bench.contestants import error_line
from jaxformer.tools.compare.leaves import error_rank
from jaxformer.training.optim import make_optimizer
from jaxformer.training.step import grad_source, init_state, make_train_step
from manual_grads import check

PASSED, FAILED, NOT_CHECKED = "passed", "failed", "not checked"
NO_CUDNN = "no GPU (cuDNN's fused attention runs only on a GPU)"

TRAIN_STEPS = 20
# Training passes when the last loss is at least 10% below the first: the tiny model on one
# batch goes from 5.54 to 2.46 (-55%) with every implementation; one that does not learn
# (a zero or wrong-signed gradient) stays at or above its first loss.
TRAIN_DROP = 0.1

# The checks judge values, not speed, and nearly all of their time is XLA compiling: their
# programs compile with the options below, which change how long XLA works on a program, not
# what it computes. On a GPU, autotuning off: at its default (level 4) XLA builds, times and
# cross-checks every candidate kernel of each matrix product; at 0 it takes its default
# kernel for the same product at the same precision. On a CPU, XLA's optimization passes and
# fusion emitters off, as the test suite compiles (tests/conftest.py): the gradient check's
# program then compiles in 3.2 s instead of 11.5 s, its worst leaf 5.3e-7 instead of 4.4e-7.
# The bench section, which judges speed, compiles as `train` does.
CHECK_COMPILE_OPTIONS = {
    "gpu": {"xla_gpu_autotune_level": 0},
    "cpu": {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
            "xla_cpu_use_fusion_emitters": False},
}


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


def compile_check(lowered, platform: str):
    """``lowered`` compiled with the platform's CHECK_COMPILE_OPTIONS, less each one the
    compiler refuses by name (an XLA that no longer has it: jaxlib 0.11's CPU compiler has no
    ``xla_cpu_use_fusion_emitters``, and still takes the other two)."""
    options = dict(CHECK_COMPILE_OPTIONS.get(platform) or {})
    while options:
        try:
            return lowered.compile(dict(options))
        except Exception as e:  # noqa: BLE001 - only the refusal of an option is retried
            refused = re.search(r"No such compile option: '([\w.]+)'", str(e))
            if refused is None or refused.group(1) not in options:
                raise
            del options[refused.group(1)]
    return lowered.compile()


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


def both_gradients(config: ModelConfig):
    """(key, batch) -> ((loss, grads) of manual_grads, (loss, grads) of jax.grad), the
    params drawn from ``key`` (init_params, float32): one program, so one compile where
    drawing the params and the two sources apart took three."""
    manual_fn = compare.manual_value_and_grad()

    def both(key, batch):
        params = init_params(key, config, jnp.float32)
        return manual_fn(params, batch, config), compare.autodiff_value_and_grad(params, batch, config)

    return both


def gradient_checks(platform: str, quick: bool, seed: int) -> list[Check]:
    """manual_grads.value_and_grad against jax.grad (both_gradients), float32, matmul
    precision highest: the loss and every leaf within check.tolerance_for("float32")
    (compare.judge, as compare-grads judges)."""
    config, B, T = gpt2_shaped(platform, quick)
    name = "manual vs jax.grad, float32"
    key, batch = jax.random.PRNGKey(seed), compare.make_batch(config, B, T, seed)
    with jax.default_matmul_precision("highest"):
        lowered = jax.jit(both_gradients(config)).lower(key, batch)
    (loss_m, grads_m), (loss_a, grads_a) = jax.device_get(compile_check(lowered, platform)(key, batch))
    tol = check.tolerance_for("float32")
    loss, leaves, failures = compare.judge(loss_m, grads_m, loss_a, grads_a, tol)
    errors = {row["path"]: row["rel"] for row in leaves}
    if not errors:  # the trees differ in structure: judge names the leaves
        return [Check("gradients", name, FAILED, "; ".join(failures))]
    at, rel = worst(errors)
    over = [row for row in leaves if not row["passed"]]
    detail = (f"worst leaf rel {rel:.1e} ({at}) {'<=' if rel <= tol else '>'} "
              f"{tol:.0e} over {len(errors)} leaves; loss rel {loss['rel']:.1e}")
    if over:
        names = ", ".join(row["path"] for row in over[:3]) + (", ..." if len(over) > 3 else "")
        detail += f"; {len(over)} of {len(errors)} leaves over ({names})"
    elif failures:
        detail += f"; {failures[0]}"
    values = {"rel": errors, "tolerance": tol, "loss": loss, "n_params": count_params(grads_a)}
    return [Check("gradients", name, FAILED if failures else PASSED, detail, values)]


# ----------------------------------------------------------------------------
# training


def train_impls(platform: str) -> list[tuple[str, str, str | None]]:
    """(attention_impl, gradient source, compute dtype) of each training run here."""
    impls = [("full", "manual", None), ("blockwise", "manual", None), ("pallas", "manual", None)]
    if platform == "gpu":  # cuDNN's kernels in the hand-derived step, bfloat16 products
        impls.append(("cudnn", "manual", "bfloat16"))
    return impls


def train_config() -> tuple[ModelConfig, int, int]:
    """The tiny preset, blockwise attention in two blocks; its recipe's batch (8 x 16)."""
    return get_preset("tiny", attention_block=8), 8, 16


def compile_train_step(config: ModelConfig, grads: str, params, batch: dict, seed: int, platform: str):
    """(make_train_step with grad_source(grads) and adam lr 1e-2, compiled for its values
    (compile_check), its first state from ``params``: host arrays, as the step donates its
    state and each run starts from its own device copy)."""
    optimizer = make_optimizer("adam", lr=1e-2)
    state = init_state(jax.device_put(params), optimizer, seed)
    return compile_check(make_train_step(grad_source(grads, config), optimizer).lower(state, batch), platform), state


def train_once(step, state, batch: dict) -> list[float]:
    """The losses of TRAIN_STEPS steps of the compiled ``step`` on ``batch`` from ``state``."""
    losses = []
    for _ in range(TRAIN_STEPS):
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return [float(x) for x in jax.device_get(losses)]


def training_checks(platform: str, seed: int) -> list[Check]:
    """One check per attention implementation (train_once), all from the same params and
    batch (drawn once: the attention implementation does not change them): every loss
    finite, the last at least TRAIN_DROP below the first. The steps compile side by side in
    threads (XLA compiles outside the GIL: on a 16-core GPU host the section takes about the
    longest compile, not their sum); each runs, and is judged, in order."""
    config, B, T = train_config()
    params = jax.device_get(init_params(jax.random.PRNGKey(seed), config, jnp.float32))
    batch = compare.make_batch(config, B, T, seed)
    runs = {}
    for impl, grads, dtype in train_impls(platform):
        mode = " (interpret mode)" if impl == "pallas" and platform == "cpu" else ""
        name = f"{impl}{mode}, {grads} grads" + (f", {dtype}" if dtype else "")
        runs[name] = config.replace(attention_impl=impl, compute_dtype=dtype), grads

    out = []
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        compiled = {name: pool.submit(compile_train_step, run_config, grads, params, batch, seed, platform)
                    for name, (run_config, grads) in runs.items()}
        for name, future in compiled.items():

            def judge(name=name, future=future):
                losses = train_once(*future.result(), batch)  # a compile that raised raises here
                finite = all(math.isfinite(x) for x in losses)
                ok = finite and losses[-1] <= (1 - TRAIN_DROP) * losses[0]
                detail = f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps"
                if not finite:
                    first = next(i for i, x in enumerate(losses) if not math.isfinite(x))
                    detail += f"; not finite from step {first + 1}"
                elif not ok:
                    detail += f"; not {TRAIN_DROP:.0%} below the first"
                return [Check("training", name, PASSED if ok else FAILED, detail, {"losses": losses})]

            out += judged("training", name, judge)
    if platform != "gpu":
        out.append(Check("training", "cudnn", NOT_CHECKED, NO_CUDNN))
    return out


# ----------------------------------------------------------------------------
# bench


# GPT-2 small's blocks on an accelerator, fewer of them: a GPU step unrolls its layers, each
# with its own kernels to compile (the step at B8 T1024 compiled deviceless for an H100 on a
# 2-core CPU: 26 s at 4 layers, 42 s at 12), and the section reports its figures, it does not
# judge them (`jaxformer bench` measures the whole depth)
BENCH_LAYERS = 4


def bench_settings(platform: str, quick: bool, seed: int) -> bench.Settings:
    """A short benchmark: tiny with ``quick``; loopos on a CPU (full attention, manual and
    jax.grad); on an accelerator GPT-2 small's blocks (BENCH_LAYERS of them) in bfloat16,
    manual gradients with the Pallas kernels (its compile is most of the section's time, so one
    contestant: cuDNN is checked for values in the kernels and training sections, and raced in
    `jaxformer bench`). The
    Pallas launch is not tuned here (8 more compiles): the launch table's entry when
    `jaxformer tune` or `bench` wrote one, else the default tiles."""
    if quick:
        config, B, T, rounds, steps, cpu_matmul, attention = get_preset("tiny"), 2, 8, 1, 1, 256, ("full",)
    elif platform == "cpu":
        config, B, T, rounds, steps, cpu_matmul, attention = get_preset("loopos"), 8, 64, 3, 2, 1024, ("full",)
    else:
        config = get_preset("gpt2", compute_dtype="bfloat16", n_layers=BENCH_LAYERS)
        B, T, rounds, steps, cpu_matmul = 8, 1024, 3, 5, 1024
        attention = ("pallas",)
    return bench.Settings(config=config, batch_size=B, seq_len=T, rounds=rounds, steps=steps, warmup=1,
                          depths=None, torch=False, torch_compile=False, cpu_matmul=cpu_matmul,
                          torch_threads=None, seed=seed, attention=attention, tune=False)


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
