"""FlashAttention-2's backward as three Pallas kernels: the rule of the forward kernel
(forward.py), which JAX's grad cannot differentiate (a ``pallas_call`` has no transpose).
entry.py pairs them: ``flash_core_fwd`` / ``flash_core_bwd`` (called by manual_grads) and
``flash_attention``, the ``jax.custom_vjp`` the model calls.

Shape letters as in forward.py (G = H // Hkv query heads per key/value head).
Forward, per query head h (key/value head h // G), query block i, key block j
(scale = 1 / sqrt(Dh)):
    S_ij = q_i k_j^T * scale                              (Kq, Kk), masked
    P_ij = exp(S_ij - lse_i)                              the softmax, recomputed from lse
    O_i  = sum_j P_ij v_j
Backward, given dO:
    1. delta kernel, grid (B, H, Nq):  D_i = rowsum(dO_i * O_i)   (= rowsum(dP_i * P_i), as O = P v;
       dO rounded to the compute dtype first, as dP's product reads it)
    2. dK/dV kernel, grid (B, H, Nk): key block j of query head h's key/value head stays
       put; walk the query blocks i it is visible to (causal: from floor(j Kk / Kq) on; with a
       sliding window W up to the block of query (j + 1) Kk + W - 2, its last key's newest reader):
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
       (causal: up to the diagonal, and from the window's first block, as the forward):
         dQ_i += dS_ij k_j * scale           undoes S_ij = q_i k_j^T * scale
Two kernels instead of one fused: each output is written by exactly one program, so
there are no atomics and each program's accumulators stay in registers.

Where they run: as the forward, the platform lowered for (platform.on_platform);
each branch pads the residuals to its own tiles, so forward and backward need not share
block sizes. Padding: dO is zero on padded query rows, so they add nothing (D = 0 there
too); padded keys have P = 0. Precision: every product reads the compute dtype (q's dtype
in the residual) and accumulates in stats_dtype; P, dP, dS, D and the accumulators stay
in stats_dtype (lse's dtype).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxformer.kernels.pallas import tune as pallas_tune
from jaxformer.kernels.pallas.forward import (block_loop, check_heads, dot, first_key_block, first_query_block, head_spec,
                                              key_blocks_seen, kv_head, launch, pad, padded_inputs,
                                              query_blocks_seen, query_segment_spec, query_spec,
                                              segment_inputs, tile_ids, tile_scores, whole_segment_spec)
from jaxformer.kernels.pallas.tiling import Tiling, plan


# ----------------------------------------------------------------------------
# the three kernels


def _delta_kernel(o_ref, do_ref, delta_ref, *, products):
    """Program (b, h, i): o_ref, do_ref (Kq, Dp) -> delta_ref (Kq, 1) = D_i. dO is rounded
    to the products' dtype first, as dP = dO v^T reads it, so that D matches rowsum(dP * P)
    and each row of dS sums to 0 up to float32 round-off (the key bias's true gradient is 0)."""
    f = delta_ref.dtype
    do = do_ref[...].astype(products).astype(f)  # (Kq, Dp)
    delta_ref[...] = jnp.sum(do * o_ref[...].astype(f), axis=1, keepdims=True)  # O = P v: D = rowsum(dO * O)


def _pair(q, k, v, do, lse, delta, i, j, t: Tiling, causal: bool, window: int = 0, seg=None):
    """One tile pair (i, j): (P_ij, dS_ij) (Kq, Kk) in lse's dtype, from q_i (Kq, Dp),
    k_j, v_j (Kk, Dp), dO_i (Kq, Dp), lse_i, D_i (Kq, 1); ``seg``: the tile's segment ids
    (query (Kq, 1), key (1, Kk)), or None."""
    f = lse.dtype
    p = jnp.exp(tile_scores(q, k, i, j, t, causal, f, window, seg) - lse)  # P_ij = exp(S_ij - lse_i)
    dp = dot(do.astype(q.dtype), v, f, (1, 1))  # O_i = sum_j P_ij v_j: dP_ij = dO_i v_j^T
    ds = p * (dp - delta)  # P_ij = softmax(S_i)_j: dS_ij = P_ij * (dP_ij - D_i)
    return p, ds


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, t: Tiling,
                 causal: bool, scale: float, window: int = 0, interpreted: bool = False):
    """Program (b, h, j): k_ref, v_ref (Kk, Dp) = k_j, v_j of key/value head h // G; q_ref,
    do_ref (Tq, Dp), lse_ref, delta_ref (Tq, 1) of query head h; refs: the ids' (none, or the
    query ids (Tq, 1) and the key ids (1, Kk), then with positions the same of the positions),
    dk_ref, dv_ref (Kk, Dp) <- query head h's share of dK_j, dV_j."""
    *ids, dk_ref, dv_ref = refs
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]  # (Kk, Dp)
    f = lse_ref.dtype

    def query_block(i, carry):
        dk, dv = carry  # (Kk, Dp) each
        rows = pl.ds(i * t.Kq, t.Kq)
        q, do = q_ref[rows, :], do_ref[rows, :]  # (Kq, Dp)
        seg = tile_ids(ids, lambda r: r[rows, :], lambda r: r[...])  # (Kq, 1), (1, Kk) each
        p, ds = _pair(q, k, v, do, lse_ref[rows, :], delta_ref[rows, :], i, j, t, causal, window, seg)
        dv = dv + dot(p.astype(q.dtype), do.astype(q.dtype), f, (0, 0))  # O = P v: dV_j += P_ij^T dO_i
        dk = dk + dot(ds.astype(q.dtype), q, f, (0, 0)) * scale  # S = q k^T scale: dK_j += dS_ij^T q_i
        return dk, dv

    zeros = jnp.zeros((t.Kk, t.Dp), f)
    dk, dv = block_loop(first_query_block(j, t, causal), query_blocks_seen(j, t, window), query_block,
                        (zeros, zeros), interpreted)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, t: Tiling, causal: bool,
               scale: float, window: int = 0, interpreted: bool = False):
    """Program (b, h, i): q_ref, do_ref (Kq, Dp) = q_i, dO_i; lse_ref, delta_ref (Kq, 1);
    k_ref, v_ref (Tk, Dp) of key/value head h // G; refs: the ids' (none, or the query ids
    (Kq, 1) and the key ids (1, Tk), then with positions the same of the positions),
    dq_ref (Kq, Dp) <- dQ_i."""
    *ids, dq_ref = refs
    i = pl.program_id(2)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    f = lse.dtype

    def key_block(j, dq):
        cols = pl.ds(j * t.Kk, t.Kk)
        k = k_ref[cols, :]  # (Kk, Dp)
        seg = tile_ids(ids, lambda r: r[...], lambda r: r[:, cols])  # (Kq, 1), (1, Kk) each
        _, ds = _pair(q, k, v_ref[cols, :], do, lse, delta, i, j, t, causal, window, seg)
        return dq + dot(ds.astype(q.dtype), k, f) * scale  # S = q k^T scale: dQ_i += dS_ij k_j

    dq = block_loop(first_key_block(i, t, window), key_blocks_seen(i, t, causal), key_block,
                    jnp.zeros((t.Kq, t.Dp), f), interpreted)
    dq_ref[...] = dq.astype(dq_ref.dtype)


def key_spec(t: Tiling, group: int = 1):
    """Key block j of head (b, h // group): (Kk, Dp) of a (B, H // group, Tk, Dp) array."""
    return pl.BlockSpec((None, None, t.Kk, t.Dp), lambda b, h, j: (b, kv_head(h, group), j, 0))


def backward_on(device: str, q, k, v, out, lse, dout, segments=None, key_segments=None, *, causal: bool,
                block_q: int = 0, block_k: int = 0, interpret=None, tuned=None, window: int = 0):
    """One platform's backward: q (B, H, T, Dh), k, v (B, Hkv, T, Dh) (products' dtype),
    out (B, H, T, Dh), lse (B, H, T), dout (B, H, T, Dh) -> dq (B, H, T, Dh), dk, dv
    (B, Hkv, T, Dh) in out's dtype: the delta pass, the dK/dV kernel (per query head,
    then summed over each group of G) and the dQ kernel, on ``device``'s tiles; ``segments``
    (B, T): the forward's document ids, or None (``key_segments``: the keys' own, as the forward's)."""
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
    segs = segment_inputs(segments, t, key_segments)  # ((B, 1, Tq, 1), (B, 1, 1, Tk)) once or twice, or ()
    static = dict(t=t, causal=causal, scale=1.0 / float(Dh) ** 0.5, window=window, interpreted=how.interpret is True)
    whole_q, whole_rows, whole_kv = head_spec(Tq, t.Dp), head_spec(Tq, 1), head_spec(Tk, t.Dp, G)
    partial_spec = pl.BlockSpec((None, None, t.Kk, t.Dp), lambda b, h, j: (b, h, j, 0))
    key_segs = pl.BlockSpec((None, None, 1, t.Kk), lambda b, h, j: (b, 0, 0, j))
    dkdv_segs = [whole_segment_spec((Tq, 1)), key_segs] * (len(segs) // 2)
    dk, dv = launch(functools.partial(_dkdv_kernel, **static), (B, H, t.Nk),
                    [whole_q, key_spec(t, G), key_spec(t, G), whole_q, whole_rows, whole_rows] + dkdv_segs,
                    [partial_spec] * 2, [jax.ShapeDtypeStruct((B, H, Tk, t.Dp), f)] * 2,
                    "flash_attention_dkdv", how)(q, k, v, do, lse, delta, *segs)  # (B, H, Tk, Dp) partials
    dq_segs = [query_segment_spec(t), whole_segment_spec((1, Tk))] * (len(segs) // 2)
    dq = launch(functools.partial(_dq_kernel, **static), (B, H, t.Nq),
                [query_spec(t), whole_kv, whole_kv, query_spec(t), query_spec(t, 1), query_spec(t, 1)] + dq_segs,
                query_spec(t), jax.ShapeDtypeStruct(q.shape, grad),
                "flash_attention_dq", how)(q, k, v, do, lse, delta, *segs)
    # query head h read key/value head h // G: its dK, dV are the sum of its G heads' shares
    dk, dv = (g.reshape(B, Hkv, G, Tk, t.Dp).sum(axis=2).astype(grad) for g in (dk, dv))
    return dq[:, :, :T, :Dh], dk[:, :, :T, :Dh], dv[:, :, :T, :Dh]
