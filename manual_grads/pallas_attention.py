"""Attention with the Pallas flash-attention core (attention_impl "pallas"), by hand.

Forward (jaxformer/model/attention.py's pallas_attention):
    q, k, v = split_qkv(x @ [wq | wk | wv] + [bq | bk | bv])   q (B, H, T, Dh), k, v (B, Hkv, T, Dh)
    q, k = rope(qk_norm(q), qk_norm(k))                   as in manual_grads/attention.py
    O, lse = the forward kernel (jaxformer/model/pallas_attention.py)
    y = merge_heads(O) @ wo + bo                          (B, T, D)
It keeps q, k, v, O and the row log-sum-exp lse: never P (B, H, T, T).

Backward, in reverse: the output projection's linear backward; the core's backward
kernels (jaxformer/model/pallas_backward.py: the delta pass D = rowsum(dO * O), then
the dK/dV kernel and the dQ kernel, the blocks above the causal diagonal skipped; each
kernel line quotes the forward line it undoes); the one q|k|v product's backward.

The core's kernels sit in the model room, beside the forward kernel, because the
model's forward wraps them as a jax.custom_vjp (JAX's grad cannot transpose a
pallas_call) and the model room imports nothing from here. The pair below is the
manual gradient source's use of them.

Mixed precision: the projections as in manual_grads/attention.py; the core reads q, k
and v in the compute dtype and accumulates in float32 (see pallas_attention.py).
"""

from __future__ import annotations

from typing import NamedTuple

from jaxformer.model.attention import merge_heads, split_heads
from jaxformer.kernels.pallas import FlashRes, flash_core_bwd, flash_core_fwd
from manual_grads.attention import HeadsRes, _proj, heads_bwd, heads_fwd, with_biases
from manual_grads.linear import LinearRes, linear_bwd, linear_fwd


class PallasAttentionRes(NamedTuple):
    heads: HeadsRes  # x (B, T, D) the input of the q, k, v projections, wq, wk, wv; QK-norm, rope
    core: FlashRes  # padded q, k, v, O and lse (see FlashRes); never the probabilities
    out: LinearRes  # the output projection's: x = merge_heads(O) (B, T, D), w = wo (D, D)


def pallas_attention_fwd(p, x, n_heads, causal, block_q=0, block_k=0, compute_dtype=None,
                         n_kv_heads=0, norm_eps=1e-5, rope_theta=0.0):
    """p = {wq, bq, wk, bk, wv, bv, wo, bo, q_norm?, k_norm?}; x (B, T, D) -> y (B, T, D).
    block_q / block_k of 0 take the device's default; every product runs in ``compute_dtype``;
    the kernels read k and v with their Hkv heads (grouped-query attention, no repeats)."""
    cd = compute_dtype
    (q, k, v), heads_res = heads_fwd(p, x, n_heads, cd, n_kv_heads, norm_eps, rope_theta)
    o, core_res = flash_core_fwd(q, k, v, causal, block_q, block_k, cd)  # (B, H, T, Dh)
    y, out_res = linear_fwd(_proj(p, "o"), merge_heads(o), cd)  # (B, T, D)
    return y, PallasAttentionRes(heads_res, core_res, out_res)


def pallas_attention_bwd(res: PallasAttentionRes, dy):
    """dy (B, T, D) -> (dp with p's keys, dx (B, T, D))."""
    heads_res, core_res, out_res = res
    H = core_res.q.shape[1]
    # y = merge_heads(O) @ wo + bo
    d_out, do = linear_bwd(out_res, dy)  # do (B, T, D)
    # O = flash attention of (q, k, v): the delta, dK/dV and dQ kernels
    dq, dk, dv = flash_core_bwd(core_res, split_heads(do, H))  # dq (B, H, T, Dh), dk, dv (B, Hkv, T, Dh)
    # q, k, v = rotate_qk(split_qkv(x @ [wq | wk | wv] + [bq | bk | bv]))
    dp, dx = heads_bwd(heads_res, dq, dk, dv)  # dx (B, T, D)
    return with_biases(dp, d_out), dx
