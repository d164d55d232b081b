"""The kernels section of ``jaxformer doctor`` (checks.py holds the others): the attention
cores against the full layer's core (softmax(q k^T / sqrt(Dh)) v from the (B, H, T, T)
probabilities, model/cores.py), forward output and the three input gradients of one
jax.vjp, causal. On a GPU or a TPU the Pallas kernels (kernels/pallas/entry.py) run
compiled, Triton or Mosaic, and the lowered program must hold their KERNELS_PER_STEP custom
calls; on a GPU cuDNN's fused attention too. On a CPU neither exists: the same kernels run in
interpret mode instead. Then the norms' kernels (kernels/pallas/norm.py, the hand-derived step's
layer norms and RMS norms beside those attention kernels on a GPU) against manual_grads' XLA
code, forward and backward."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.kernels.pallas import norm as norm_kernels
from jaxformer.model.cores import AttentionSpec, cudnn, flash, full, repeat_kv
from jaxformer.tools.doctor.checks import (FAILED, NO_CUDNN, NOT_CHECKED, PASSED, Check, compile_check,
                                           judged, worst)
from manual_grads import check
from manual_grads.layer_norm import layer_norm_bwd, layer_norm_fwd
from manual_grads.rms_norm import rms_norm_bwd, rms_norm_fwd

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
# The norms' kernels against the XLA code in float32: the two sum a row in different orders
# (2e-7 to 6e-7 measured in interpret mode, tests/test_norm_kernel.py), so 1e-5 as for attention.
NORM_TOL = 1e-5
NORM_CALLS = 4  # a layer norm's and an RMS norm's forward and backward


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


def run_core(core, inputs, platform: str) -> tuple[dict, str]:
    """(core_vjp's arrays on the host, the lowered program's text), one compile
    (checks.compile_check)."""
    lowered = jax.jit(functools.partial(core_vjp, core)).lower(*inputs)
    return jax.device_get(compile_check(lowered, platform)(*inputs)), lowered.as_text()


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
        ref, _ = run_core(full_core, inputs, platform)
        full_bf16 = worst(rels(ref, run_core(functools.partial(full_core, compute_dtype="bfloat16"),
                                             inputs, platform)[0]))[1]
        yardstick = f"; full attention in bfloat16: {full_bf16:.1e}"
        for dtype in ("float32", "bfloat16"):
            name = f"pallas {dtype} ({mode})"

            def pallas(dtype=dtype, name=name):
                core = functools.partial(pallas_core, compute_dtype=None if dtype == "float32" else dtype,
                                         block_q=s.block_q, block_k=s.block_k)
                got, text = run_core(core, inputs, platform)
                calls = (platform, text.count(KERNEL_CALLS[platform])) if compiled else None
                return [kernel_verdict(name, rels(ref, got), KERNEL_TOL[dtype],
                                       yardstick if dtype == "bfloat16" else "", calls)]

            out += judged("kernels", name, pallas)
        if platform == "gpu":
            out += judged("kernels", "cudnn bfloat16", lambda: [kernel_verdict(
                "cudnn bfloat16", rels(ref, run_core(cudnn_core, inputs, platform)[0]), KERNEL_TOL["bfloat16"],
                yardstick)])
        else:
            out.append(Check("kernels", "cudnn bfloat16", NOT_CHECKED, NO_CUDNN))
    if platform != "tpu":  # a TPU's step keeps XLA's norms
        out += norm_check(platform, seed)
    return out


def norm_pair(x, dy, skip, scale, bias, rms: bool, interpret: bool):
    """One norm forward and backward, by the kernels (``interpret``: on a CPU) and by
    manual_grads' XLA code: ({y, xhat, rstd, dx, dscale, dbias} each)."""
    offset = 1.0 if rms else 0.0
    y, xhat, rstd = norm_kernels.norm_forward(x, scale, None if rms else bias, eps=1e-5, rms=rms, offset=offset,
                                              interpret=interpret)
    dx, ds, db = norm_kernels.norm_backward(dy, xhat, rstd, offset + scale, rms=rms, skip=skip, interpret=interpret)
    got = {"y": y, "xhat": xhat, "rstd": rstd, "dx": dx, "dscale": ds.sum(axis=0), "dbias": db.sum(axis=0)}
    if rms:
        y, res = rms_norm_fwd({"scale": scale}, x, 1e-5, offset)
        dp, dx = rms_norm_bwd(res, dy)
        dp["bias"] = dy.reshape(-1, dy.shape[-1]).sum(axis=0)
    else:
        y, res = layer_norm_fwd({"scale": scale, "bias": bias}, x, 1e-5)
        dp, dx = layer_norm_bwd(res, dy)
    ref = {"y": y, "xhat": res.xhat, "rstd": res.rstd, "dx": dx + skip, "dscale": dp["scale"], "dbias": dp["bias"]}
    return ref, got


def norm_check(platform: str, seed: int) -> list[Check]:
    """The norms' kernels (a layer norm with a bias, an RMS norm with Gemma's offset, each with
    a skip connection's gradient; rows of 96 features, one of them large) against the XLA code
    in float32, compiled on a GPU (two Triton calls each), in interpret mode elsewhere."""
    compiled = platform == "gpu"
    name = f"norm kernels float32 ({'Triton' if compiled else 'interpret mode'})"
    rng = np.random.default_rng(seed)
    x, dy, skip = (jnp.asarray(rng.standard_normal((2, 40, 96)), jnp.float32) for _ in range(3))
    x = x.at[0, 3].multiply(1e4) + 0.5
    scale, bias = (jnp.asarray(1.0 + 0.3 * rng.standard_normal(96), jnp.float32) for _ in range(2))

    def run():
        errors, calls = {}, 0
        for rms in (False, True):
            pair = jax.jit(functools.partial(norm_pair, rms=rms, interpret=not compiled))
            lowered = pair.lower(x, dy, skip, scale, bias)
            ref, got = jax.device_get(compile_check(lowered, platform)(x, dy, skip, scale, bias))
            errors.update({f"{'rms' if rms else 'layer'} {k}": v for k, v in rels(ref, got).items()})
            calls += lowered.as_text().count(KERNEL_CALLS["gpu"])
        at, rel = worst(errors)
        ok = bool(rel <= NORM_TOL) and (not compiled or calls >= NORM_CALLS)
        detail = f"worst rel {rel:.1e} ({at}) {'<=' if rel <= NORM_TOL else '>'} {NORM_TOL:.0e}"
        if compiled:
            detail += f"; {calls} Triton kernel calls compiled" + ("" if calls >= NORM_CALLS else
                                                                    f", not {NORM_CALLS}: the kernels did not compile")
        return [Check("kernels", name, PASSED if ok else FAILED, detail, {"rel": errors, "tolerance": NORM_TOL})]

    return judged("kernels", name, run)
