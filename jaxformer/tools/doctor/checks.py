"""The checks of ``jaxformer doctor``, each on the device JAX runs on (device 0), each
returning ``Check`` rows: passed, failed, or not checked (and why).

- kernels: the attention cores against the full layer's core (softmax(q k^T / sqrt(Dh)) v
  from the (B, H, T, T) probabilities, model/attention.py), forward output and the three
  input gradients of one jax.vjp, causal. On a GPU or a TPU the Pallas kernels
  (pallas_backward.flash_attention) run compiled, Triton or Mosaic, and the lowered
  program must hold their KERNELS_PER_STEP custom calls; on a GPU cuDNN's fused
  attention too. On a CPU neither exists: the same kernels run in interpret mode instead.
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

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.model.config import ModelConfig, get_preset
from jaxformer.model.cores import AttentionSpec, cudnn, flash, full, repeat_kv
from jaxformer.model.params import init_params
from jaxformer.tools.bench import run as bench
from jaxformer.tools.compare import grads as compare
from jaxformer.tools.bench.contestants import error_line
from jaxformer.tools.compare.leaves import error_rank
from jaxformer.training.optim import make_optimizer
from jaxformer.training.step import grad_source, init_state, make_train_step
from manual_grads import check

PASSED, FAILED, NOT_CHECKED = "passed", "failed", "not checked"

# Relative error allowed for a kernel's output and gradients against full attention in
# float32. float32: round-off only (unit 6e-8), the kernel and the layer summing the same
# products in another order (online softmax, key blocks): 2.3e-7 to 2.5e-7 measured in
# interpret mode, so 1e-5 leaves 40x room and still fails a real mistake (a dQ off by 10%
# reads 1.0e-1, tests/test_doctor.py). bfloat16: each product reads inputs rounded to
# 8 significant bits (unit 2^-9, 2e-3) and the gradients chain three such products
# (dP = dO v^T, dS, dQ = dS k): 4.0e-3 to 4.7e-3 measured for the kernel, 3.9e-3 to
# 4.4e-3 for full attention in bfloat16 itself; 2e-2 is 10 units, 4x the measurement.
KERNEL_TOL = {"float32": 1e-5, "bfloat16": 2e-2}
KERNEL_CALLS = {"gpu": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}  # a compiled kernel's call
KERNEL_NAMES = {"gpu": "Triton", "tpu": "Mosaic"}
KERNELS_PER_STEP = 4  # forward, delta, dK/dV, dQ: one of each in a forward + vjp
NO_PALLAS = "no GPU/TPU (Pallas compiles for cuda/rocm/tpu only; cpu runs interpret mode)"
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
# kernels


class KernelShape(NamedTuple):
    B: int
    H: int
    T: int  # not a multiple of the blocks: the padded tail is checked too
    Dh: int
    block_q: int = 0  # 0: the device's blocks (autotuned on a GPU)
    block_k: int = 0

    def text(self) -> str:
        blocks = f", blocks {self.block_q}x{self.block_k}" if self.block_q else ""
        return f"B{self.B} H{self.H} T{self.T} Dh{self.Dh}{blocks}, causal"


def kernel_shape(platform: str, quick: bool) -> KernelShape:
    """A GPT-2 head width on an accelerator; on a CPU (interpret mode: a loop per grid
    program) a tiny one, with small blocks so that several query and key blocks run."""
    if platform == "cpu":
        return KernelShape(1, 2, 40, 8, 16, 8) if quick else KernelShape(2, 2, 72, 16, 32, 16)
    return KernelShape(1, 2, 72, 64) if quick else KernelShape(2, 4, 200, 64)


def full_core(q, k, v, compute_dtype=None):
    """The model's ``full`` core (model/cores.py), causal, k and v repeated to q's heads."""
    G = q.shape[1] // k.shape[1]
    spec = AttentionSpec(causal=True, compute_dtype=compute_dtype)
    return full(q, repeat_kv(k, G), repeat_kv(v, G), spec).astype(q.dtype)


def pallas_core(q, k, v, compute_dtype=None, block_q=0, block_k=0):
    """The model's ``flash`` core: the Pallas forward kernel, its backward kernels under jax.vjp."""
    return flash(q, k, v, AttentionSpec(causal=True, compute_dtype=compute_dtype, block_q=block_q,
                                        block_k=block_k))


def cudnn_core(q, k, v, compute_dtype="bfloat16"):
    """The model's ``cudnn`` core (attention_impl "cudnn"), causal, its output in float32."""
    return cudnn(q, k, v, AttentionSpec(causal=True, compute_dtype=compute_dtype)).astype(jnp.float32)


def core_vjp(core, q, k, v, do):
    """{out, dq, dk, dv} of ``core`` at q, k, v (B, H, T, Dh) float32, cotangent do."""
    out, vjp = jax.vjp(core, q, k, v)
    dq, dk, dv = vjp(do)
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


def run_core(core, inputs) -> tuple[dict, str]:
    """(core_vjp's arrays on the host, the lowered program's text), one compile."""
    lowered = jax.jit(functools.partial(core_vjp, core)).lower(*inputs)
    return jax.device_get(lowered.compile()(*inputs)), lowered.as_text()


def attention_inputs(s: KernelShape, seed: int) -> tuple:
    """q, k, v, dO (B, H, T, Dh) float32, standard normal (scores of unit scale)."""
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((s.B, s.H, s.T, s.Dh)), jnp.float32) for _ in range(4))


def rels(ref: dict, got: dict) -> dict:
    """{out, dq, dk, dv: relative error of got against ref}."""
    return {c.path.strip("[]'"): c.rel for c in check.compare_trees(ref, got)}


def kernel_verdict(name: str, errors: dict, tol: float, extra: str = "",
                   calls: tuple[str, int] | None = None) -> Check:
    """One kernel check: every array within ``tol``; on an accelerator also the kernels
    compiled (``calls``: the platform, how many kernel custom calls the program holds)."""
    at, rel = worst(errors)
    ok = bool(rel <= tol)
    detail = f"worst rel {rel:.1e} ({at}) {'<=' if ok else '>'} {tol:.0e}{extra}"
    values = {"rel": errors, "tolerance": tol}
    if calls is not None:
        platform, n = calls
        values["kernel_calls"] = n
        if n < KERNELS_PER_STEP:
            ok = False
            detail += (f"; the program holds {n} {KERNEL_NAMES[platform]} calls, not "
                       f"{KERNELS_PER_STEP}: the kernels did not compile for {platform}")
        else:
            detail += f"; {n} {KERNEL_NAMES[platform]} kernel calls compiled"
    return Check("kernels", name, PASSED if ok else FAILED, detail, values)


def kernel_checks(platform: str, quick: bool, seed: int) -> list[Check]:
    """Pallas (float32, bfloat16) and on a GPU cuDNN (bfloat16) against full attention in
    float32; each bfloat16 line also gives full attention's own bfloat16 error."""
    s = kernel_shape(platform, quick)
    inputs = attention_inputs(s, seed)
    compiled = platform in KERNEL_CALLS
    mode = KERNEL_NAMES[platform] if compiled else "interpret mode"
    out = []
    if not compiled:
        out.append(Check("kernels", "pallas compiled kernels", NOT_CHECKED, NO_PALLAS))
    with jax.default_matmul_precision("highest"):
        ref, _ = run_core(full_core, inputs)
        full_bf16 = worst(rels(ref, run_core(functools.partial(full_core, compute_dtype="bfloat16"),
                                             inputs)[0]))[1]
        yardstick = f"; full attention in bfloat16: {full_bf16:.1e}"
        for dtype in ("float32", "bfloat16"):
            name = f"pallas {dtype} ({mode})"

            def pallas(dtype=dtype, name=name):
                core = functools.partial(pallas_core, compute_dtype=None if dtype == "float32" else dtype,
                                         block_q=s.block_q, block_k=s.block_k)
                got, text = run_core(core, inputs)
                calls = (platform, text.count(KERNEL_CALLS[platform])) if compiled else None
                return [kernel_verdict(name, rels(ref, got), KERNEL_TOL[dtype],
                                       yardstick if dtype == "bfloat16" else "", calls)]

            out += judged("kernels", name, pallas)
        if platform == "gpu":
            out += judged("kernels", "cudnn bfloat16", lambda: [kernel_verdict(
                "cudnn bfloat16", rels(ref, run_core(cudnn_core, inputs)[0]), KERNEL_TOL["bfloat16"],
                yardstick)])
        else:
            out.append(Check("kernels", "cudnn bfloat16", NOT_CHECKED, NO_CUDNN))
    return out


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
