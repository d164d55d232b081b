"""The blockwise attention core's pair, with the FlashAttention-2 backward.

Forward (jaxformer/model/blockwise.py), per head, in blocks of K = spec.block positions:
    O, lse = online softmax of S = q k^T / sqrt(Dh) over key blocks, times v
                                              (S = c tanh(S / c) first with spec.softcap c)
It keeps q, k, v, O and the row log-sum-exp lse (B, H, T): never P (B, H, T, T). The
projections around it, and the choice of core, are manual_grads/attention.py's.

Backward, with P_ij = exp(S_ij - lse_i) recomputed one (query block, key block)
pair at a time (pairs above the causal diagonal, or past a sliding window, skipped, as in
the forward; with segment ids, pairs of two documents masked as the forward masks them):
    D_i  = rowsum(dO_i * O_i)                 = rowsum(dP_i * P_i), the softmax's correction
    dV_j += P_ij^T dO_i                       undoes O = P v
    dP_ij = dO_i v_j^T
    dS_ij = P_ij * (dP_ij - D_i)              undoes P = softmax(S)
    dS_ij *= 1 - (S_ij / c)^2                 undoes S = c tanh(S / c), with spec.softcap c: the
                                              capped S_ij recomputed, before the mask
With dropout on the probabilities (a key), pair (i, j)'s mask is redrawn from
block_pair_key(key, i, j): dV_j += drop(P_ij)^T dO_i and dP_ij = drop(dO_i v_j^T);
D_i = rowsum(dO_i * O_i) still equals rowsum(dP_i * P_i), since O = drop(P) v.
    dq_i += dS_ij k_j / sqrt(Dh),  dk_j += dS_ij^T q_i / sqrt(Dh)   undo S = q k^T / sqrt(Dh)

Mixed precision: every product above, forward and backward, reads its inputs in the
compute dtype and accumulates in float32 (``jaxformer.model.precision.matmul``); P, dS,
D, lse and the running sums dq, dk, dv stay in float32 or wider.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.blockwise import (block_size, blockwise_attention_core, capped_block_scores, clamp,
                                       from_blocks, if_visible, key_blocks, mask_block, pair_dropout,
                                       pair_segments, segment_blocks, to_blocks)
from jaxformer.model.cores import AttentionSpec
from jaxformer.model.dropout import active, dropout
from jaxformer.model.precision import matmul, stats_dtype
from manual_grads.softcap import softcap_bwd


class BlockwiseCoreRes(NamedTuple):
    q: jax.Array  # (N, B, H, K, Dh) blocks of q, zero-padded to N * K positions
    k: jax.Array  # (N, B, H, K, Dh)
    v: jax.Array  # (N, B, H, K, Dh)
    out: jax.Array  # (N, B, H, K, Dh) O = softmax(S) v
    lse: jax.Array  # (N, B, H, K) row log-sum-exp of the scores, in stats_dtype
    length: jax.Array  # (T,) int: arange(T); its length is T, the unpadded sequence length
    key: jax.Array | None  # the key each pair's dropout mask is redrawn from; None: no dropout
    spec: AttentionSpec  # static: the mask rule, the products' dtype, the dropout rate
    segments: jax.Array | None = None  # (N, B, 1, K) int: segment_blocks of the document ids; None: one document


def blockwise_core_fwd(q, k, v, spec: AttentionSpec, key=None, segments=None):
    """q, k, v (B, H, T, Dh) -> out (B, H, T, Dh), keeping blocks of q, k, v, out and lse.
    The products run in spec.compute_dtype (None: q's dtype); with a ``key`` the
    probabilities go through dropout (the residual keeps the key, not the masks); ``segments``
    (B, T): the document ids (kept in blocks)."""
    T = q.shape[2]
    K = block_size(T, spec.block)
    out, lse = blockwise_attention_core(q, k, v, spec, key, segments)  # (B, H, T, Dh), (B, H, T)
    blocks = [to_blocks(a, K) for a in (q, k, v, out, lse)]
    return out, BlockwiseCoreRes(*blocks, jnp.arange(T), key if active(spec.dropout, key) else None, spec,
                                 segment_blocks(segments, K))


def _softmax_correction(dout, out):
    """D = rowsum(dO * O) (B, H, T) in stats_dtype: equals rowsum(dP * P) since O = P v."""
    f = stats_dtype(out.dtype)
    return jnp.sum(dout.astype(f) * out.astype(f), axis=-1)


def pair_bwd(carry, q_i, do_i, lse_i, d_i, k_j, v_j, i, j, T, spec: AttentionSpec, key=None, seg=None):
    """One (query block i, key block j) pair: add its share to dq_i, dk_j, dv_j.
    The four products run in spec.compute_dtype with float32 accumulation; ``key``: the
    probabilities' dropout at spec.dropout, the pair's mask redrawn; ``seg``: the pair's
    segment ids (blockwise.pair_segments), or None."""
    dq_i, dk_j, dv_j = carry  # (B, H, K, Dh) each, stats_dtype
    scale = 1.0 / math.sqrt(q_i.shape[-1])
    f, cd = dq_i.dtype, spec.compute_dtype
    s = capped_block_scores(q_i, k_j, spec)  # (B, H, K, K): S_ij, capped with spec.softcap
    p = jnp.exp(mask_block(s, i, j, T, spec, seg) - lse_i[..., None])  # (B, H, K, K): P_ij
    drop = pair_dropout(spec.dropout, key, i, j)
    pd = p if drop is None else dropout(p, *drop)  # (B, H, K, K): drop(P_ij), the mask redrawn
    dv_j = dv_j + matmul(jnp.swapaxes(pd, -1, -2), do_i.astype(f), cd)  # O = drop(P) v
    dp = matmul(do_i.astype(f), jnp.swapaxes(v_j, -1, -2).astype(f), cd)  # (B, H, K, K)
    dp = dp if drop is None else dropout(dp, *drop)  # drop(P) = P * keep / (1 - rate)
    ds = p * (dp - d_i[..., None])  # P = softmax(S)
    if spec.softcap:  # s = softcap(s, spec.softcap): 1 - tanh^2 from the capped s itself
        ds = softcap_bwd(s / spec.softcap, ds)
    dq_i = dq_i + matmul(ds, k_j.astype(f), cd) * scale  # S = q k^T / sqrt(Dh)
    dk_j = dk_j + matmul(jnp.swapaxes(ds, -1, -2), q_i.astype(f), cd) * scale
    return dq_i, dk_j, dv_j


def blockwise_core_bwd(res: BlockwiseCoreRes, dout):
    """dout (B, H, T, Dh) -> (dq, dk, dv) (B, H, T, Dh): FlashAttention-2's backward.

    The outer scan walks the query blocks i (emitting dq_i); the inner scan walks the
    key blocks j (``key_blocks``: those a sliding window reaches, or all), skipping j > i
    when causal, and adds into dk, dv (N, B, H, K, Dh)."""
    qb, kb, vb, ob, lseb, length, key, spec, sb = res
    T, K = length.shape[0], qb.shape[3]
    f = lseb.dtype
    dob = to_blocks(dout, K)  # (N, B, H, K, Dh); padded rows get dO = 0
    db = _softmax_correction(dob, ob)  # (N, B, H, K)
    idx = jnp.arange(qb.shape[0])

    N = qb.shape[0]

    def query_step(dkv, xs):
        q_i, do_i, lse_i, d_i, i = xs

        def key_step(carry, j):
            dq_i, dk, dv = carry
            jc = clamp(j, N)  # j itself where visible
            pair = (dq_i, dk[jc], dv[jc])
            add_pair = lambda c: pair_bwd(c, q_i, do_i, lse_i, d_i, kb[jc], vb[jc], i, j, T, spec, key,  # noqa: E731
                                          pair_segments(sb, i, jc))
            dq_i, dk_j, dv_j = if_visible(i, j, spec, add_pair, pair)
            return (dq_i, dk.at[jc].set(dk_j), dv.at[jc].set(dv_j)), None

        (dq_i, dk, dv), _ = jax.lax.scan(key_step, (jnp.zeros(q_i.shape, f),) + dkv, key_blocks(i, spec, K, N))
        return (dk, dv), dq_i

    zeros = jnp.zeros(kb.shape, f)
    (dkb, dvb), dqb = jax.lax.scan(query_step, (zeros, zeros), (qb, dob, lseb, db, idx))
    dtype = qb.dtype
    return tuple(from_blocks(g, T).astype(dtype) for g in (dqb, dkb, dvb))
