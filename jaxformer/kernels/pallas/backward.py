"""FlashAttention-2's backward as three Pallas kernels, and ``flash_attention``: the
forward kernel (pallas_attention.py) as a ``jax.custom_vjp`` whose rule they are.

A ``pallas_call`` has no transpose, so JAX's grad cannot differentiate the forward
kernel; the model's forward for attention_impl "pallas" calls ``flash_attention``,
whose backward is the hand-derived one below. The manual gradient source
(manual_grads/pallas_attention.py) calls the same pair, ``flash_core_fwd`` and
``flash_core_bwd``. Both live here, in the model room, because the model's custom_vjp
needs them and the model room imports nothing from manual_grads/.

Shape letters as in pallas_attention.py (G = H // Hkv query heads per key/value head).
Forward, per query head h (key/value head h // G), query block i, key block j
(scale = 1 / sqrt(Dh)):
    S_ij = q_i k_j^T * scale                              (Kq, Kk), masked
    P_ij = exp(S_ij - lse_i)                              the softmax, recomputed from lse
    O_i  = sum_j P_ij v_j
Backward, given dO:
    1. delta kernel, grid (B, H, Nq):  D_i = rowsum(dO_i * O_i)   (= rowsum(dP_i * P_i), as O = P v;
       dO rounded to the compute dtype first, as dP's product reads it)
    2. dK/dV kernel, grid (B, H, Nk): key block j of query head h's key/value head stays
       put; walk the query blocks i it is visible to (causal: from floor(j Kk / Kq) on):
         dV_j += P_ij^T dO_i                 undoes O_i = sum_j P_ij v_j
         dP_ij = dO_i v_j^T                  (the same line, for P)
         dS_ij = P_ij * (dP_ij - D_i)        undoes P_ij = softmax(S_i)_j
         dK_j += dS_ij^T q_i * scale         undoes S_ij = q_i k_j^T * scale
       It writes per-query-head partials (B, H, Tk, Dp) in stats_dtype; the G partials of
       each key/value head are summed right after (undoes the read of head h // G by G
       query heads). Why not inside the kernel: a program per (b, h, j) keeps the grid
       B * H * Nk wide (a program looping over G heads leaves MQA with B * Nk programs),
       writes each output block once (no atomics) and takes any G (Triton's blocks are
       powers of two, G need not be); the cost is G - 1 extra (B, Hkv, T, Dh) buffers,
       FlashAttention-2's own choice ("dk_expanded").
    3. dQ kernel, grid (B, H, Nq): query block i stays put; walk the key blocks it sees
       (causal: up to the diagonal, as the forward):
         dQ_i += dS_ij k_j * scale           undoes S_ij = q_i k_j^T * scale
Two kernels instead of one fused: each output is written by exactly one program, so
there are no atomics and each program's accumulators stay in registers.

Where they run: as the forward, the platform lowered for (pallas_attention.on_platform);
each branch pads the residuals to its own tiles, so forward and backward need not share
block sizes. Padding: dO is zero on padded query rows, so they add nothing (D = 0 there
too); padded keys have P = 0. Precision: every product reads the compute dtype (q's dtype
in the residual) and accumulates in stats_dtype; P, dP, dS, D and the accumulators stay
in stats_dtype (lse's dtype).
"""

from __future__ import annotations

import functools
import math
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxformer.kernels.pallas import tune as pallas_tune
from jaxformer.kernels.pallas.forward import (Tiling, check_heads, dot, first_query_block, forward_on,
                                              head_spec, key_blocks_seen, kv_head, launch, on_platform, pad,
                                              padded_inputs, pallas_attention_core, plan, query_spec,
                                              tile_scores)


class FlashRes(NamedTuple):
    """Bidirectional; CausalFlashRes (same fields) undoes the causal forward. Unpadded:
    each platform's backward pads to its own tiles. T and Dh are q's, G = H // Hkv."""
    q: jax.Array  # (B, H, T, Dh) in the products' dtype (the compute dtype, or q's own)
    k: jax.Array  # (B, Hkv, T, Dh) in the products' dtype
    v: jax.Array  # (B, Hkv, T, Dh)
    out: jax.Array  # (B, H, T, Dh) O, in the dtype of the forward's q (before the cast)
    lse: jax.Array  # (B, H, T) row log-sum-exp of S, in stats_dtype
    blocks: jax.Array  # (block_q, block_k, 0) int32, empty: the requested block sizes (0: the device's)


class CausalFlashRes(FlashRes):
    pass


def res_blocks(res: FlashRes) -> tuple[int, int]:
    """The block sizes the forward was asked for, read back from the residual's shapes."""
    return res.blocks.shape[-3], res.blocks.shape[-2]


def flash_core_fwd(q, k, v, causal: bool, block_q: int = 0, block_k: int = 0, compute_dtype=None):
    """q (B, H, T, Dh), k, v (B, Hkv, T, Dh) -> (out (B, H, T, Dh) in q's dtype, FlashRes):
    the forward kernel, keeping q, k, v (in the products' dtype), O and lse; never the
    (B, H, T, T) probabilities."""
    G = check_heads(q, k, v)
    cd = jnp.dtype(compute_dtype or q.dtype)
    if not (block_q or block_k):  # on a GPU process, tune this shape once (None elsewhere)
        pallas_tune.choice(pallas_tune.Shape(*q.shape[2:], cd.name, causal, G), time_on_gpu)
    branch = functools.partial(forward_on, causal=causal, block_q=block_q, block_k=block_k, compute_dtype=cd)
    out, lse = on_platform(branch, q, k, v)  # (B, H, T, Dh), (B, H, T)
    res_type = CausalFlashRes if causal else FlashRes
    blocks = jnp.zeros((block_q, block_k, 0), jnp.int32)
    return out, res_type(q.astype(cd), k.astype(cd), v.astype(cd), out, lse, blocks)


# ----------------------------------------------------------------------------
# the three kernels


def _delta_kernel(o_ref, do_ref, delta_ref, *, products):
    """Program (b, h, i): o_ref, do_ref (Kq, Dp) -> delta_ref (Kq, 1) = D_i. dO is rounded
    to the products' dtype first, as dP = dO v^T reads it, so that D matches rowsum(dP * P)
    and each row of dS sums to 0 up to float32 round-off (the key bias's true gradient is 0)."""
    f = delta_ref.dtype
    do = do_ref[...].astype(products).astype(f)  # (Kq, Dp)
    delta_ref[...] = jnp.sum(do * o_ref[...].astype(f), axis=1, keepdims=True)  # O = P v: D = rowsum(dO * O)


def _pair(q, k, v, do, lse, delta, i, j, t: Tiling, causal: bool):
    """One tile pair (i, j): (P_ij, dS_ij) (Kq, Kk) in lse's dtype, from q_i (Kq, Dp),
    k_j, v_j (Kk, Dp), dO_i (Kq, Dp), lse_i, D_i (Kq, 1)."""
    f = lse.dtype
    p = jnp.exp(tile_scores(q, k, i, j, t, causal, f) - lse)  # P_ij = exp(S_ij - lse_i)
    dp = dot(do.astype(q.dtype), v, f, (1, 1))  # O_i = sum_j P_ij v_j: dP_ij = dO_i v_j^T
    ds = p * (dp - delta)  # P_ij = softmax(S_i)_j: dS_ij = P_ij * (dP_ij - D_i)
    return p, ds


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, t: Tiling,
                 causal: bool, scale: float):
    """Program (b, h, j): k_ref, v_ref (Kk, Dp) = k_j, v_j of key/value head h // G; q_ref,
    do_ref (Tq, Dp), lse_ref, delta_ref (Tq, 1) of query head h; dk_ref, dv_ref (Kk, Dp) <-
    query head h's share of dK_j, dV_j."""
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]  # (Kk, Dp)
    f = lse_ref.dtype

    def query_block(i, carry):
        dk, dv = carry  # (Kk, Dp) each
        rows = pl.ds(i * t.Kq, t.Kq)
        q, do = q_ref[rows, :], do_ref[rows, :]  # (Kq, Dp)
        p, ds = _pair(q, k, v, do, lse_ref[rows, :], delta_ref[rows, :], i, j, t, causal)
        dv = dv + dot(p.astype(q.dtype), do.astype(q.dtype), f, (0, 0))  # O = P v: dV_j += P_ij^T dO_i
        dk = dk + dot(ds.astype(q.dtype), q, f, (0, 0)) * scale  # S = q k^T scale: dK_j += dS_ij^T q_i
        return dk, dv

    zeros = jnp.zeros((t.Kk, t.Dp), f)
    dk, dv = jax.lax.fori_loop(first_query_block(j, t, causal), t.Nq, query_block, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, t: Tiling, causal: bool,
               scale: float):
    """Program (b, h, i): q_ref, do_ref (Kq, Dp) = q_i, dO_i; lse_ref, delta_ref (Kq, 1);
    k_ref, v_ref (Tk, Dp) of key/value head h // G; dq_ref (Kq, Dp) <- dQ_i."""
    i = pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    f = lse.dtype

    def key_block(j, dq):
        cols = pl.ds(j * t.Kk, t.Kk)
        k = k_ref[cols, :]  # (Kk, Dp)
        _, ds = _pair(q, k, v_ref[cols, :], do, lse, delta, i, j, t, causal)
        return dq + dot(ds.astype(q.dtype), k, f) * scale  # S = q k^T scale: dQ_i += dS_ij k_j

    dq = jax.lax.fori_loop(0, key_blocks_seen(i, t, causal), key_block, jnp.zeros((t.Kq, t.Dp), f))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def key_spec(t: Tiling, group: int = 1):
    """Key block j of head (b, h // group): (Kk, Dp) of a (B, H // group, Tk, Dp) array."""
    return pl.BlockSpec((None, None, t.Kk, t.Dp), lambda b, h, j: (b, kv_head(h, group), j, 0))


def backward_on(device: str, q, k, v, out, lse, dout, *, causal: bool, block_q: int = 0,
                block_k: int = 0, interpret=None, tuned=None):
    """One platform's backward: q (B, H, T, Dh), k, v (B, Hkv, T, Dh) (products' dtype),
    out (B, H, T, Dh), lse (B, H, T), dout (B, H, T, Dh) -> dq (B, H, T, Dh), dk, dv
    (B, Hkv, T, Dh) in out's dtype: the delta pass, the dK/dV kernel (per query head,
    then summed over each group of G) and the dQ kernel, on ``device``'s tiles."""
    (B, H, T, Dh), Hkv, G = q.shape, k.shape[1], check_heads(q, k, v)
    t, how = plan(device, pallas_tune.Shape(T, Dh, q.dtype.name, causal, G), block_q, block_k,
                  interpret, tuned)
    Tq, Tk, f, grad = t.Nq * t.Kq, t.Nk * t.Kk, lse.dtype, out.dtype
    q, k, v = padded_inputs(q, k, v, t)  # (B, H, Tq, Dp), (B, Hkv, Tk, Dp) twice
    out, do = pad(out, Tq, t.Dp), pad(dout.astype(grad), Tq, t.Dp)  # (B, H, Tq, Dp): dO 0 on padded rows
    lse = pad(lse, Tq)[..., None]  # (B, H, Tq, 1)
    rows = jax.ShapeDtypeStruct(lse.shape, f)
    delta = launch(functools.partial(_delta_kernel, products=q.dtype), (B, H, t.Nq),
                   [query_spec(t), query_spec(t)], query_spec(t, 1), rows,
                   "flash_attention_delta", how)(out, do)  # (B, H, Tq, 1)
    static = dict(t=t, causal=causal, scale=1.0 / float(Dh) ** 0.5)
    whole_q, whole_rows, whole_kv = head_spec(Tq, t.Dp), head_spec(Tq, 1), head_spec(Tk, t.Dp, G)
    partial_spec = pl.BlockSpec((None, None, t.Kk, t.Dp), lambda b, h, j: (b, h, j, 0))
    dk, dv = launch(functools.partial(_dkdv_kernel, **static), (B, H, t.Nk),
                    [whole_q, key_spec(t, G), key_spec(t, G), whole_q, whole_rows, whole_rows],
                    [partial_spec] * 2, [jax.ShapeDtypeStruct((B, H, Tk, t.Dp), f)] * 2,
                    "flash_attention_dkdv", how)(q, k, v, do, lse, delta)  # (B, H, Tk, Dp) partials
    dq = launch(functools.partial(_dq_kernel, **static), (B, H, t.Nq),
                [query_spec(t), whole_kv, whole_kv, query_spec(t), query_spec(t, 1), query_spec(t, 1)],
                query_spec(t), jax.ShapeDtypeStruct(q.shape, grad),
                "flash_attention_dq", how)(q, k, v, do, lse, delta)
    # query head h read key/value head h // G: its dK, dV are the sum of its G heads' shares
    dk, dv = (g.reshape(B, Hkv, G, Tk, t.Dp).sum(axis=2).astype(grad) for g in (dk, dv))
    return dq[:, :, :T, :Dh], dk[:, :, :T, :Dh], dv[:, :, :T, :Dh]


def flash_core_bwd(res: FlashRes, dout):
    """dout (B, H, T, Dh) -> (dq (B, H, T, Dh), dk, dv (B, Hkv, T, Dh)) in out's dtype, by
    the backward kernels of the platform lowered for (pairs above the causal diagonal skipped)."""
    block_q, block_k = res_blocks(res)
    branch = functools.partial(backward_on, causal=isinstance(res, CausalFlashRes),
                               block_q=block_q, block_k=block_k)
    return on_platform(branch, res.q, res.k, res.v, res.out, res.lse, dout)


def time_step(device: str, q, k, v, do, causal: bool, tuned: pallas_tune.Choice):
    """The forward and backward kernels at the ``tuned`` launch, no platform switch: what
    pallas_tune times (q, do (B, H, T, Dh), k, v (B, Hkv, T, Dh) -> dq, dk, dv)."""
    out, lse = forward_on(device, q, k, v, causal=causal, tuned=tuned)
    return backward_on(device, q, k, v, out, lse, do, causal=causal, tuned=tuned)


def time_on_gpu(shape: pallas_tune.Shape, c: pallas_tune.Choice, repeats: int = 5) -> float:
    """Seconds of the Triton forward and backward kernels at ``c`` on one (1, 4 G, T, Dh)
    attention (4 key/value heads), the best of ``repeats`` after a warm-up: pallas_tune's
    measure. Runs eagerly even while a caller traces (ensure_compile_time_eval)."""
    def step(q, k, v, do):
        return time_step("gpu", q, k, v, do, shape.causal, c)

    rng, dtype = np.random.default_rng(0), jnp.dtype(shape.dtype)
    q, do = (rng.standard_normal((1, 4 * shape.G, shape.T, shape.Dh)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((1, 4, shape.T, shape.Dh)).astype(dtype) for _ in range(2))
    with jax.ensure_compile_time_eval():
        run = jax.jit(step).lower(q, k, v, do).compile()
        jax.block_until_ready(run(q, k, v, do))
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(run(q, k, v, do))
            best = min(best, time.perf_counter() - start)
    return best


# ----------------------------------------------------------------------------
# the model's differentiable core: the forward kernel, with the kernels above as its rule


def _flash_fwd_rule(q, k, v, causal, block_q, block_k, compute_dtype):
    return flash_core_fwd(q, k, v, causal, block_q, block_k, compute_dtype)


def _flash_bwd_rule(causal, block_q, block_k, compute_dtype, res, dout):
    return flash_core_bwd(res, dout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def flash_attention(q, k, v, causal: bool, block_q: int = 0, block_k: int = 0, compute_dtype=None):
    """q (B, H, T, Dh), k, v (B, Hkv, T, Dh), H a multiple of Hkv -> softmax(q k^T / sqrt(Dh)) v
    (B, H, T, Dh), query head h reading key/value head h // (H // Hkv), future masked if
    causal: the forward kernel, differentiable (JAX's grad runs flash_core_bwd; dk, dv come
    back (B, Hkv, T, Dh)). block_q / block_k of 0 take the device's choice (pallas_tune on a
    GPU, else pallas_attention.DEFAULT_BLOCKS); products in ``compute_dtype``."""
    return pallas_attention_core(q, k, v, causal, block_q, block_k, compute_dtype)[0]


flash_attention.defvjp(_flash_fwd_rule, _flash_bwd_rule)
