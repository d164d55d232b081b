"""Attention with the Pallas flash-attention core (attention_impl "pallas"), by hand.

Forward (jaxformer/model/attention.py's pallas_attention):
    q, k, v = split_qkv(x @ [wq | wk | wv] + [bq | bk | bv])   (B, H, T, Dh) each
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
from jaxformer.model.pallas_backward import FlashRes, flash_core_bwd, flash_core_fwd
from manual_grads.attention import QKVRes, _proj, qkv_bwd, qkv_fwd, with_biases
from manual_grads.linear import LinearRes, linear_bwd, linear_fwd


class PallasAttentionRes(NamedTuple):
    qkv: QKVRes  # x (B, T, D) the input of the q, k, v projections, wq, wk, wv (D, D)
    core: FlashRes  # padded q, k, v, O and lse (see FlashRes); never the probabilities
    out: LinearRes  # the output projection's: x = merge_heads(O) (B, T, D), w = wo (D, D)


def pallas_attention_fwd(p, x, n_heads, causal, block_q=0, block_k=0, compute_dtype=None):
    """p = {wq, bq, wk, bk, wv, bv, wo, bo}; x (B, T, D) -> y (B, T, D). block_q / block_k
    of 0 take the device's default; every product runs in ``compute_dtype``."""
    cd = compute_dtype
    (q, k, v), qkv_res = qkv_fwd(p, x, n_heads, cd)  # (B, H, T, Dh) each
    o, core_res = flash_core_fwd(q, k, v, causal, block_q, block_k, cd)  # (B, H, T, Dh)
    y, out_res = linear_fwd(_proj(p, "o"), merge_heads(o), cd)  # (B, T, D)
    return y, PallasAttentionRes(qkv_res, core_res, out_res)


def pallas_attention_bwd(res: PallasAttentionRes, dy):
    """dy (B, T, D) -> (dp with p's keys, dx (B, T, D))."""
    qkv_res, core_res, out_res = res
    H = core_res.q.shape[1]
    # y = merge_heads(O) @ wo + bo
    d_out, do = linear_bwd(out_res, dy)  # do (B, T, D)
    # O = flash attention of (q, k, v): the delta, dK/dV and dQ kernels
    dq, dk, dv = flash_core_bwd(core_res, split_heads(do, H))  # (B, H, T, Dh) each
    # q, k, v = split_qkv(x @ [wq | wk | wv] + [bq | bk | bv])
    dp, dx = qkv_bwd(qkv_res, dq, dk, dv)  # dx (B, T, D)
    return with_biases(dp, d_out), dx
