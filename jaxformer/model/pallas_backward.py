"""FlashAttention-2's backward as three Pallas kernels, and ``flash_attention``: the
forward kernel (pallas_attention.py) as a ``jax.custom_vjp`` whose rule they are.

A ``pallas_call`` has no transpose, so JAX's grad cannot differentiate the forward
kernel; the model's forward for attention_impl "pallas" calls ``flash_attention``,
whose backward is the hand-derived one below. The manual gradient source
(manual_grads/pallas_attention.py) calls the same pair, ``flash_core_fwd`` and
``flash_core_bwd``. Both live here, in the model room, because the model's custom_vjp
needs them and the model room imports nothing from manual_grads/.

Shape letters as in pallas_attention.py. Forward, per head, for query block i and key
block j (scale = 1 / sqrt(Dh)):
    S_ij = q_i k_j^T * scale                              (Kq, Kk), masked
    P_ij = exp(S_ij - lse_i)                              the softmax, recomputed from lse
    O_i  = sum_j P_ij v_j
Backward, given dO:
    1. delta kernel, grid (B, H, Nq):  D_i = rowsum(dO_i * O_i)   (= rowsum(dP_i * P_i), as O = P v;
       dO rounded to the compute dtype first, as dP's product reads it)
    2. dK/dV kernel, grid (B, H, Nk): key block j stays put; walk the query blocks i it
       is visible to (causal: from floor(j Kk / Kq) on):
         dV_j += P_ij^T dO_i                 undoes O_i = sum_j P_ij v_j
         dP_ij = dO_i v_j^T                  (the same line, for P)
         dS_ij = P_ij * (dP_ij - D_i)        undoes P_ij = softmax(S_i)_j
         dK_j += dS_ij^T q_i * scale         undoes S_ij = q_i k_j^T * scale
    3. dQ kernel, grid (B, H, Nq): query block i stays put; walk the key blocks it sees
       (causal: up to the diagonal, as the forward):
         dQ_i += dS_ij k_j * scale           undoes S_ij = q_i k_j^T * scale
Two kernels instead of one fused: each output is written by exactly one program, so
there are no atomics and each program's accumulators stay in registers.

Padding: dO is zero on padded query rows, so they add nothing (D = 0 there too);
padded keys have P = 0. Precision: every product reads the compute dtype (q's dtype in
the residual) and accumulates in stats_dtype; P, dP, dS, D and the accumulators
stay in stats_dtype (lse's dtype).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxformer.model.pallas_attention import (Tiling, dot, first_query_block, flash_forward, head_spec,
                                              key_blocks_seen, launch, pad, padded_inputs,
                                              pallas_attention_core, query_spec, row_spec,
                                              tile_scores, tiling)


class FlashRes(NamedTuple):
    """Bidirectional; CausalFlashRes (same fields) undoes the causal forward. The block
    sizes are the shapes' (Kq = lse.shape[-1], Kk = k.shape[-2]), T is len(length), Dh is
    out.shape[-1]; the products' dtype is q's, the gradients' out's."""
    q: jax.Array  # (B, H, Nq, Kq, Dp) zero-padded, in the products' dtype
    k: jax.Array  # (B, H, Nk, Kk, Dp)
    v: jax.Array  # (B, H, Nk, Kk, Dp)
    out: jax.Array  # (B, H, Nq, Kq, Dh) O, in the dtype of the forward's q (before the cast)
    lse: jax.Array  # (B, H, Nq, Kq) row log-sum-exp of S, in stats_dtype
    length: jax.Array  # (T,) int32 arange(T): its length is T, the unpadded sequence length


class CausalFlashRes(FlashRes):
    pass


def res_tiling(res: FlashRes) -> Tiling:
    """The forward's Tiling, read back from the residual's shapes."""
    Nq, Kq = res.lse.shape[2:]
    Nk, Kk, Dp = res.k.shape[2:]
    return Tiling(res.length.shape[0], Kq, Kk, Nq, Nk, res.out.shape[-1], Dp)


def flash_core_fwd(q, k, v, causal: bool, block_q: int = 0, block_k: int = 0, compute_dtype=None):
    """q, k, v (B, H, T, Dh) -> (out (B, H, T, Dh) in q's dtype, FlashRes): the forward
    kernel, keeping q, k, v (padded, in the products' dtype), O and lse; never the
    (B, H, T, T) probabilities."""
    B, H, T, Dh = q.shape
    t = tiling(T, Dh, block_q, block_k)
    qp, kp, vp = padded_inputs(q, k, v, t, compute_dtype)  # (B, H, Tq, Dp), (B, H, Tk, Dp) twice
    out, lse = flash_forward(qp, kp, vp, causal, t, q.dtype)  # (B, H, Tq, Dp), (B, H, Tq)
    out = out[..., :Dh]
    res_type = CausalFlashRes if causal else FlashRes
    res = res_type(qp.reshape(B, H, t.Nq, t.Kq, t.Dp), kp.reshape(B, H, t.Nk, t.Kk, t.Dp),
                   vp.reshape(B, H, t.Nk, t.Kk, t.Dp), out.reshape(B, H, t.Nq, t.Kq, Dh),
                   lse.reshape(B, H, t.Nq, t.Kq), jnp.arange(T, dtype=jnp.int32))
    return out[:, :, :T], res


# ----------------------------------------------------------------------------
# the three kernels


def _delta_kernel(o_ref, do_ref, delta_ref, *, products):
    """Program (b, h, i): o_ref, do_ref (Kq, Dp) -> delta_ref (Kq,) = D_i. dO is rounded
    to the products' dtype first, as dP = dO v^T reads it, so that D matches rowsum(dP * P)
    and each row of dS sums to 0 up to float32 round-off (the key bias's true gradient is 0)."""
    f = delta_ref.dtype
    do = do_ref[...].astype(products).astype(f)  # (Kq, Dp)
    delta_ref[...] = jnp.sum(do * o_ref[...].astype(f), axis=1)  # O = P v: D = rowsum(dO * O) = rowsum(dP * P)


def _pair(q, k, v, do, lse, delta, i, j, t: Tiling, causal: bool):
    """One tile pair (i, j): (P_ij, dS_ij) (Kq, Kk) in lse's dtype, from q_i (Kq, Dp),
    k_j, v_j (Kk, Dp), dO_i (Kq, Dp), lse_i, D_i (Kq,)."""
    f = lse.dtype
    p = jnp.exp(tile_scores(q, k, i, j, t, causal, f) - lse[:, None])  # P_ij = exp(S_ij - lse_i)
    dp = dot(do.astype(q.dtype), v, f, (1, 1))  # O_i = sum_j P_ij v_j: dP_ij = dO_i v_j^T
    ds = p * (dp - delta[:, None])  # P_ij = softmax(S_i)_j: dS_ij = P_ij * (dP_ij - D_i)
    return p, ds


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, t: Tiling,
                 causal: bool, scale: float):
    """Program (b, h, j): k_ref, v_ref (Kk, Dp) = k_j, v_j; q_ref, do_ref (Tq, Dp), lse_ref,
    delta_ref (Tq,) of this head; dk_ref, dv_ref (Kk, Dp) <- dK_j, dV_j."""
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]  # (Kk, Dp)
    f = lse_ref.dtype

    def query_block(i, carry):
        dk, dv = carry  # (Kk, Dp) each
        rows = pl.ds(i * t.Kq, t.Kq)
        q, do = q_ref[rows, :], do_ref[rows, :]  # (Kq, Dp)
        p, ds = _pair(q, k, v, do, lse_ref[rows], delta_ref[rows], i, j, t, causal)
        dv = dv + dot(p.astype(q.dtype), do.astype(q.dtype), f, (0, 0))  # O = P v: dV_j += P_ij^T dO_i
        dk = dk + dot(ds.astype(q.dtype), q, f, (0, 0)) * scale  # S = q k^T scale: dK_j += dS_ij^T q_i
        return dk, dv

    zeros = jnp.zeros((t.Kk, t.Dp), f)
    dk, dv = jax.lax.fori_loop(first_query_block(j, t, causal), t.Nq, query_block, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, t: Tiling, causal: bool,
               scale: float):
    """Program (b, h, i): q_ref, do_ref (Kq, Dp) = q_i, dO_i; lse_ref, delta_ref (Kq,);
    k_ref, v_ref (Tk, Dp) of this head; dq_ref (Kq, Dp) <- dQ_i."""
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


def key_spec(t: Tiling):
    """Key block j of head (b, h): (Kk, Dp) of a (B, H, Tk, Dp) array."""
    return pl.BlockSpec((None, None, t.Kk, t.Dp), lambda b, h, j: (b, h, j, 0))


def head_rows_spec(length: int):
    """All of head (b, h): (length,) of a (B, H, length) array, for any program."""
    return pl.BlockSpec((None, None, length), lambda b, h, n: (b, h, 0))


def flash_core_bwd(res: FlashRes, dout):
    """dout (B, H, T, Dh) -> (dq, dk, dv) (B, H, T, Dh) in out's dtype: the delta pass,
    then the dK/dV kernel and the dQ kernel (pairs above the causal diagonal skipped)."""
    causal = isinstance(res, CausalFlashRes)
    t = res_tiling(res)
    B, H = res.q.shape[:2]
    Tq, Tk = t.Nq * t.Kq, t.Nk * t.Kk
    q, k, v = res.q.reshape(B, H, Tq, t.Dp), res.k.reshape(B, H, Tk, t.Dp), res.v.reshape(B, H, Tk, t.Dp)
    out = pad(res.out.reshape(B, H, Tq, t.Dh), Tq, t.Dp)  # (B, H, Tq, Dp)
    lse = res.lse.reshape(B, H, Tq)
    do = pad(dout.astype(out.dtype), Tq, t.Dp)  # (B, H, Tq, Dp): 0 on padded rows
    grad = out.dtype
    delta = launch(functools.partial(_delta_kernel, products=q.dtype), (B, H, t.Nq),
                   [query_spec(t), query_spec(t)], row_spec(t),
                   jax.ShapeDtypeStruct(lse.shape, lse.dtype), "flash_attention_delta")(out, do)  # (B, H, Tq)
    static = dict(t=t, causal=causal, scale=1.0 / float(t.Dh) ** 0.5)
    whole_q, whole_k, rows = head_spec(Tq, t), head_spec(Tk, t), head_rows_spec(Tq)
    dk, dv = launch(functools.partial(_dkdv_kernel, **static), (B, H, t.Nk),
                    [whole_q, key_spec(t), key_spec(t), whole_q, rows, rows],
                    [key_spec(t), key_spec(t)], [jax.ShapeDtypeStruct(k.shape, grad)] * 2,
                    "flash_attention_dkdv")(q, k, v, do, lse, delta)
    dq = launch(functools.partial(_dq_kernel, **static), (B, H, t.Nq),
                [query_spec(t), whole_k, whole_k, query_spec(t), row_spec(t), row_spec(t)],
                query_spec(t), jax.ShapeDtypeStruct(q.shape, grad),
                "flash_attention_dq")(q, k, v, do, lse, delta)
    return tuple(g[:, :, :t.T, :t.Dh] for g in (dq, dk, dv))


# ----------------------------------------------------------------------------
# the model's differentiable core: the forward kernel, with the kernels above as its rule


def _flash_fwd_rule(q, k, v, causal, block_q, block_k, compute_dtype):
    return flash_core_fwd(q, k, v, causal, block_q, block_k, compute_dtype)


def _flash_bwd_rule(causal, block_q, block_k, compute_dtype, res, dout):
    return flash_core_bwd(res, dout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def flash_attention(q, k, v, causal: bool, block_q: int = 0, block_k: int = 0, compute_dtype=None):
    """q, k, v (B, H, T, Dh) -> softmax(q k^T / sqrt(Dh)) v (B, H, T, Dh), future masked if
    causal: the forward kernel, differentiable (JAX's grad runs flash_core_bwd).
    block_q / block_k of 0 take the device default; products in ``compute_dtype``."""
    return pallas_attention_core(q, k, v, causal, block_q, block_k, compute_dtype)[0]


flash_attention.defvjp(_flash_fwd_rule, _flash_bwd_rule)
