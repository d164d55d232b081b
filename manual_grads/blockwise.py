"""Blockwise (flash-style) attention, with the FlashAttention-2 backward.

Forward (jaxformer/blockwise.py), per head, in blocks of K positions:
    q, k, v = split_qkv(x @ [wq | wk | wv] + [bq | bk | bv])   q (B, H, T, Dh), k, v (B, Hkv, T, Dh)
    q, k = rope(qk_norm(q), qk_norm(k)); k, v repeated to H heads   as in manual_grads/attention.py
    O, lse = online softmax of S = q k^T / sqrt(Dh) over key blocks, times v
    y = merge_heads(O) @ wo + bo                          (B, T, D)
It keeps q, k, v, O and the row log-sum-exp lse (B, H, T): never P (B, H, T, T).

Backward, with P_ij = exp(S_ij - lse_i) recomputed one (query block, key block)
pair at a time (pairs above the causal diagonal skipped, as in the forward):
    D_i  = rowsum(dO_i * O_i)                 = rowsum(dP_i * P_i), the softmax's correction
    dV_j += P_ij^T dO_i                       undoes O = P v
    dP_ij = dO_i v_j^T
    dS_ij = P_ij * (dP_ij - D_i)              undoes P = softmax(S)
With dropout on the probabilities (a key), pair (i, j)'s mask is redrawn from
block_pair_key(key, i, j): dV_j += drop(P_ij)^T dO_i and dP_ij = drop(dO_i v_j^T);
D_i = rowsum(dO_i * O_i) still equals rowsum(dP_i * P_i), since O = drop(P) v.
    dq_i += dS_ij k_j / sqrt(Dh),  dk_j += dS_ij^T q_i / sqrt(Dh)   undo S = q k^T / sqrt(Dh)
then the projections' backwards (one q|k|v product, one output), as in manual_grads/attention.py.

Mixed precision: every product above, forward and backward, reads its inputs in the
compute dtype and accumulates in float32 (``jaxformer.blockwise.matmul``); P, dS,
D, lse and the running sums dq, dk, dv stay in float32 or wider.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.blockwise import (block_scores, block_size, blockwise_attention_core,
                                       from_blocks, if_visible, matmul, pair_dropout, to_blocks)
from jaxformer.model.dropout import dropout
from jaxformer.model.precision import stats_dtype
from jaxformer.model.config import ModelConfig
from jaxformer.model.attention import merge_heads, repeat_kv, split_heads
from manual_grads.attention import (HeadsRes, _proj, attention_bwd, attention_fwd, head_options,
                                    heads_bwd, heads_fwd, sum_groups, with_biases)
from manual_grads.linear import LinearRes, linear_bwd, linear_fwd
from manual_grads.pallas_attention import PallasAttentionRes, pallas_attention_bwd, pallas_attention_fwd


class BlockwiseCoreRes(NamedTuple):
    """Bidirectional; CausalBlockwiseCoreRes (same fields) undoes the causal forward."""
    q: jax.Array  # (N, B, H, K, Dh) blocks of q, zero-padded to N * K positions
    k: jax.Array  # (N, B, H, K, Dh)
    v: jax.Array  # (N, B, H, K, Dh)
    out: jax.Array  # (N, B, H, K, Dh) O = softmax(S) v
    lse: jax.Array  # (N, B, H, K) row log-sum-exp of the scores, in stats_dtype
    length: jax.Array  # (T,) int: arange(T); its length is T, the unpadded sequence length
    products: jax.Array  # (0,) empty, in the dtype the products read: compute_dtype, or q's
    dropout_rate: jax.Array | None = None  # () the probabilities' dropout rate; None: no dropout
    dropout_key: jax.Array | None = None  # the key each pair's mask is redrawn from


class CausalBlockwiseCoreRes(BlockwiseCoreRes):
    pass


def blockwise_core_fwd(q, k, v, causal, block, compute_dtype=None, dropout_rate=0.0, key=None):
    """q, k, v (B, H, T, Dh) -> out (B, H, T, Dh), keeping blocks of q, k, v, out and lse.
    The products run in ``compute_dtype`` (None: q's dtype); with a ``key`` the
    probabilities go through dropout (the residual keeps the key, not the masks)."""
    T = q.shape[2]
    K = block_size(T, block)
    out, lse = blockwise_attention_core(q, k, v, causal, block, compute_dtype, dropout_rate,
                                        key)  # (B, H, T, Dh), (B, H, T)
    res_type = CausalBlockwiseCoreRes if causal else BlockwiseCoreRes
    blocks = [to_blocks(a, K) for a in (q, k, v, out, lse)]
    products = jnp.zeros((0,), compute_dtype or q.dtype)
    drop = (None, None) if key is None or not dropout_rate else (jnp.asarray(dropout_rate), key)
    return out, res_type(*blocks, jnp.arange(T), products, *drop)


def products_dtype(res: BlockwiseCoreRes):
    """The compute dtype the forward's products ran in: None (plain ``@``) when q's own."""
    return None if res.products.dtype == res.q.dtype else res.products.dtype


def _softmax_correction(dout, out):
    """D = rowsum(dO * O) (B, H, T) in stats_dtype: equals rowsum(dP * P) since O = P v."""
    f = stats_dtype(out.dtype)
    return jnp.sum(dout.astype(f) * out.astype(f), axis=-1)


def pair_bwd(carry, q_i, do_i, lse_i, d_i, k_j, v_j, i, j, T, causal, cd=None, rate=None, key=None):
    """One (query block i, key block j) pair: add its share to dq_i, dk_j, dv_j.
    The four products run in the compute dtype ``cd`` with float32 accumulation;
    ``key`` (with ``rate``): the probabilities' dropout, the pair's mask redrawn."""
    dq_i, dk_j, dv_j = carry  # (B, H, K, Dh) each, stats_dtype
    scale = 1.0 / math.sqrt(q_i.shape[-1])
    f = dq_i.dtype
    p = jnp.exp(block_scores(q_i, k_j, i, j, T, causal, cd) - lse_i[..., None])  # (B, H, K, K): P_ij
    drop = pair_dropout(rate, key, i, j)
    pd = p if drop is None else dropout(p, *drop)  # (B, H, K, K): drop(P_ij), the mask redrawn
    dv_j = dv_j + matmul(jnp.swapaxes(pd, -1, -2), do_i.astype(f), cd)  # O = drop(P) v
    dp = matmul(do_i.astype(f), jnp.swapaxes(v_j, -1, -2).astype(f), cd)  # (B, H, K, K)
    dp = dp if drop is None else dropout(dp, *drop)  # drop(P) = P * keep / (1 - rate)
    ds = p * (dp - d_i[..., None])  # P = softmax(S)
    dq_i = dq_i + matmul(ds, k_j.astype(f), cd) * scale  # S = q k^T / sqrt(Dh)
    dk_j = dk_j + matmul(jnp.swapaxes(ds, -1, -2), q_i.astype(f), cd) * scale
    return dq_i, dk_j, dv_j


def blockwise_core_bwd(res: BlockwiseCoreRes, dout):
    """dout (B, H, T, Dh) -> (dq, dk, dv) (B, H, T, Dh): FlashAttention-2's backward.

    The outer scan walks the query blocks i (emitting dq_i); the inner scan walks the
    key blocks j, skipping j > i when causal, and adds into dk, dv (N, B, H, K, Dh)."""
    causal = isinstance(res, CausalBlockwiseCoreRes)
    cd = products_dtype(res)
    qb, kb, vb, ob, lseb, length, _, rate, key = res
    T, K = length.shape[0], qb.shape[3]
    f = lseb.dtype
    dob = to_blocks(dout, K)  # (N, B, H, K, Dh); padded rows get dO = 0
    db = _softmax_correction(dob, ob)  # (N, B, H, K)
    idx = jnp.arange(qb.shape[0])

    def query_step(dkv, xs):
        q_i, do_i, lse_i, d_i, i = xs

        def key_step(carry, j):
            dq_i, dk, dv = carry
            pair = (dq_i, dk[j], dv[j])
            add_pair = lambda c: pair_bwd(c, q_i, do_i, lse_i, d_i, kb[j], vb[j], i, j, T, causal, cd,  # noqa: E731
                                            rate, key)
            dq_i, dk_j, dv_j = if_visible(i, j, causal, add_pair, pair)
            return (dq_i, dk.at[j].set(dk_j), dv.at[j].set(dv_j)), None

        (dq_i, dk, dv), _ = jax.lax.scan(key_step, (jnp.zeros(q_i.shape, f),) + dkv, idx)
        return (dk, dv), dq_i

    zeros = jnp.zeros(kb.shape, f)
    (dkb, dvb), dqb = jax.lax.scan(query_step, (zeros, zeros), (qb, dob, lseb, db, idx))
    dtype = qb.dtype
    return tuple(from_blocks(g, T).astype(dtype) for g in (dqb, dkb, dvb))


# ----------------------------------------------------------------------------
# the layer: projections around the blockwise core


class BlockwiseAttentionRes(NamedTuple):
    heads: HeadsRes  # x (B, T, D) the input of the q, k, v projections, wq, wk, wv; QK-norm, rope
    core: BlockwiseCoreRes  # blocks of q, k, v, O and lse; never the (B, H, T, T) probabilities
    out: LinearRes  # the output projection's: x = merge_heads(O) (B, T, D), w = wo (D, D)


def blockwise_attention_fwd(p, x, n_heads, causal, block, compute_dtype=None, dropout_rate=0.0,
                            key=None, n_kv_heads=0, norm_eps=1e-5, rope_theta=0.0):
    """p = {wq, bq, wk, bk, wv, bv, wo, bo, q_norm?, k_norm?}; x (B, T, D) -> y (B, T, D).
    Every product, the projections' and the blocks', runs in ``compute_dtype``; ``key``:
    the probabilities' dropout; n_kv_heads, norm_eps, rope_theta as attention_fwd's."""
    cd = compute_dtype
    (q, k, v), heads_res = heads_fwd(p, x, n_heads, cd, n_kv_heads, norm_eps, rope_theta)
    G = n_heads // k.shape[1]
    o, core_res = blockwise_core_fwd(q, repeat_kv(k, G), repeat_kv(v, G), causal, block, cd,
                                     dropout_rate, key)  # (B, H, T, Dh)
    y, out_res = linear_fwd(_proj(p, "o"), merge_heads(o), cd)  # (B, T, D)
    return y, BlockwiseAttentionRes(heads_res, core_res, out_res)


def blockwise_attention_bwd(res: BlockwiseAttentionRes, dy):
    """dy (B, T, D) -> (dp with p's keys, dx (B, T, D))."""
    heads_res, core_res, out_res = res
    H, Hkv = core_res.q.shape[2], heads_res.qkv.wk.shape[1] // core_res.q.shape[-1]
    # y = merge_heads(O) @ wo + bo
    d_out, do = linear_bwd(out_res, dy)  # do (B, T, D)
    # O = blockwise_attention_core(q, repeat_kv(k), repeat_kv(v))
    dq, dk, dv = blockwise_core_bwd(core_res, split_heads(do, H))  # (B, H, T, Dh) each
    dk, dv = sum_groups(dk, Hkv), sum_groups(dv, Hkv)  # (B, Hkv, T, Dh)
    # q, k, v = rotate_qk(split_qkv(x @ [wq | wk | wv] + [bq | bk | bv]))
    dp, dx = heads_bwd(heads_res, dq, dk, dv)  # dx (B, T, D)
    return with_biases(dp, d_out), dx


# ----------------------------------------------------------------------------
# choosing by config (forward) and by residual type (backward)


def any_attention_fwd(p, x, config: ModelConfig, key=None):
    """The attention layer config.attention_impl names: full, blockwise or pallas
    ("cudnn" has no hand-derived backward and is refused); ``key``: the probabilities'
    dropout key (full, blockwise; ModelConfig refuses dropout with pallas)."""
    if config.attention_impl == "cudnn":
        raise ValueError("attention_impl 'cudnn' has no hand-derived backward (cuDNN's kernel is "
                         "differentiated by JAX's grad only): the manual gradient source cannot run "
                         "it; use --grads auto, or attention_impl 'pallas' for a hand-written "
                         "flash-attention backward")
    heads = head_options(config)
    if config.attention_impl == "pallas":
        return pallas_attention_fwd(p, x, config.n_heads, config.causal, config.pallas_block_q,
                                    config.pallas_block_k, config.compute_dtype, **heads)
    if config.attention_impl == "blockwise":
        return blockwise_attention_fwd(p, x, config.n_heads, config.causal, config.attention_block,
                                       config.compute_dtype, config.dropout, key, **heads)
    return attention_fwd(p, x, config.n_heads, config.causal, config.compute_dtype, config.dropout, key,
                         **heads)


def any_attention_bwd(res, dy):
    """Undoes whichever attention forward made ``res``."""
    if isinstance(res, PallasAttentionRes):
        return pallas_attention_bwd(res, dy)
    if isinstance(res, BlockwiseAttentionRes):
        return blockwise_attention_bwd(res, dy)
    return attention_bwd(res, dy)
