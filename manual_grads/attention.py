"""Multi-head scaled dot-product attention with q/k/v/out projections.

Forward, per head h (columns h*Dh:(h+1)*Dh of the projections):
    q, k, v = x @ wq + bq, x @ wk + bk, x @ wv + bv      (B, H, T, Dh) after split_heads
    S = q k^T / sqrt(Dh)                                   (B, H, T, T), future masked if causal
    P = softmax(S)                                         (B, H, T, T)
    y = merge_heads(P v) @ wo + bo                         (B, T, D)

Mixed precision: x, q, k, v are kept in the compute dtype (the matmul inputs the
forward used), the probabilities in float32; the backward's products run in the
dtype of q with float32 accumulation.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.layers import attention_probs, cast, matmul, merge_heads, split_heads
from manual_grads.linear import LinearRes, backward_dtype, linear_bwd, linear_fwd


class AttentionRes(NamedTuple):
    x: jax.Array  # (B, T, D) the input of the q, k, v projections, in the compute dtype
    q: jax.Array  # (B, H, T, Dh) in the compute dtype, as are k and v
    k: jax.Array  # (B, H, T, Dh)
    v: jax.Array  # (B, H, T, Dh)
    probs: jax.Array  # (B, H, T, T) softmax of the scores (float32 or wider); 0 where masked
    out: LinearRes  # the output projection's: x = merge_heads(probs @ v) (B, T, D), w = wo (D, D)
    wq: jax.Array  # (D, D)
    wk: jax.Array  # (D, D)
    wv: jax.Array  # (D, D)


def _proj(p, name):
    return {"w": p["w" + name], "b": p["b" + name]}


def attention_fwd(p, x, n_heads, causal, compute_dtype=None):
    """p = {wq, bq, wk, bk, wv, bv, wo, bo}; x (B, T, D) -> y (B, T, D)."""
    cd = compute_dtype
    q = split_heads(linear_fwd(_proj(p, "q"), x, cd)[0], n_heads)  # (B, H, T, Dh)
    k = split_heads(linear_fwd(_proj(p, "k"), x, cd)[0], n_heads)  # (B, H, T, Dh)
    v = split_heads(linear_fwd(_proj(p, "v"), x, cd)[0], n_heads)  # (B, H, T, Dh)
    probs = attention_probs(q, k, causal, cd)  # (B, H, T, T)
    y, out_res = linear_fwd(_proj(p, "o"), merge_heads(matmul(probs, v, cd)), cd)  # (B, T, D)
    q, k, v, x = (cast(a, cd) for a in (q, k, v, x))  # what the products read
    return y, AttentionRes(x, q, k, v, probs, out_res, p["wq"], p["wk"], p["wv"])


def softmax_bwd(probs, dprobs):
    """Undoes ``P = softmax(S)`` along the last axis: dS = P * (dP - rowsum(dP * P)).
    Masked scores have P = 0, so they get dS = 0; the max subtracted for
    stability cancels out of the softmax and gets no gradient."""
    return probs * (dprobs - jnp.sum(dprobs * probs, axis=-1, keepdims=True))


def attention_bwd(res: AttentionRes, dy):
    """dy (B, T, D) -> (dp with p's keys, dx (B, T, D))."""
    x, q, k, v, probs, out_res, wq, wk, wv = res
    H, Dh = q.shape[1], q.shape[-1]
    cd = backward_dtype(q, wq)
    # y = merge_heads(probs @ v) @ wo + bo
    d_out, datt = linear_bwd(out_res, dy)  # datt (B, T, D)
    datt = split_heads(datt, H)  # (B, H, T, Dh)
    # att = probs @ v
    dprobs = matmul(datt, jnp.swapaxes(v, -1, -2), cd)  # (B, H, T, T)
    dv = matmul(jnp.swapaxes(probs, -1, -2), datt, cd)  # (B, H, T, Dh)
    # probs = softmax(q k^T / sqrt(Dh))
    dscores = softmax_bwd(probs, dprobs) / math.sqrt(Dh)  # (B, H, T, T)
    dq = matmul(dscores, k, cd)  # (B, H, T, Dh)
    dk = matmul(jnp.swapaxes(dscores, -1, -2), q, cd)  # (B, H, T, Dh)
    # q, k, v = split_heads(x @ w + b): the three projections read x, so their dx add
    d_q, dx_q = linear_bwd(LinearRes(x, wq), merge_heads(dq))  # dx_q (B, T, D)
    d_k, dx_k = linear_bwd(LinearRes(x, wk), merge_heads(dk))  # dx_k (B, T, D)
    d_v, dx_v = linear_bwd(LinearRes(x, wv), merge_heads(dv))  # dx_v (B, T, D)
    dp = {"wq": d_q["w"], "bq": d_q["b"], "wk": d_k["w"], "bk": d_k["b"],
          "wv": d_v["w"], "bv": d_v["b"], "wo": d_out["w"], "bo": d_out["b"]}
    return dp, dx_q + dx_k + dx_v
