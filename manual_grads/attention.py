"""Multi-head scaled dot-product attention with q/k/v/out projections.

Forward, per head h (columns h*Dh:(h+1)*Dh of the projections):
    q, k, v = x @ wq + bq, x @ wk + bk, x @ wv + bv      (B, H, T, Dh) after split_heads
    S = q k^T / sqrt(Dh)                                   (B, H, T, T), future masked if causal
    P = softmax(S)                                         (B, H, T, T)
    y = merge_heads(P v) @ wo + bo                         (B, T, D)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.layers import attention_probs, merge_heads, split_heads
from manual_grads.linear import LinearRes, linear_bwd, linear_fwd


class AttentionRes(NamedTuple):
    x: jax.Array  # (B, T, D) the input of the q, k, v projections
    q: jax.Array  # (B, H, T, Dh)
    k: jax.Array  # (B, H, T, Dh)
    v: jax.Array  # (B, H, T, Dh)
    probs: jax.Array  # (B, H, T, T) softmax of the scores; 0 where causally masked
    out: LinearRes  # the output projection's: x = merge_heads(probs @ v) (B, T, D), w = wo (D, D)
    wq: jax.Array  # (D, D)
    wk: jax.Array  # (D, D)
    wv: jax.Array  # (D, D)


def _proj(p, name):
    return {"w": p["w" + name], "b": p["b" + name]}


def attention_fwd(p, x, n_heads, causal):
    """p = {wq, bq, wk, bk, wv, bv, wo, bo}; x (B, T, D) -> y (B, T, D)."""
    q = split_heads(linear_fwd(_proj(p, "q"), x)[0], n_heads)  # (B, H, T, Dh)
    k = split_heads(linear_fwd(_proj(p, "k"), x)[0], n_heads)  # (B, H, T, Dh)
    v = split_heads(linear_fwd(_proj(p, "v"), x)[0], n_heads)  # (B, H, T, Dh)
    probs = attention_probs(q, k, causal)  # (B, H, T, T)
    y, out_res = linear_fwd(_proj(p, "o"), merge_heads(probs @ v))  # (B, T, D)
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
    # y = merge_heads(probs @ v) @ wo + bo
    d_out, datt = linear_bwd(out_res, dy)  # datt (B, T, D)
    datt = split_heads(datt, H)  # (B, H, T, Dh)
    # att = probs @ v
    dprobs = datt @ jnp.swapaxes(v, -1, -2)  # (B, H, T, T)
    dv = jnp.swapaxes(probs, -1, -2) @ datt  # (B, H, T, Dh)
    # probs = softmax(q k^T / sqrt(Dh))
    dscores = softmax_bwd(probs, dprobs) / math.sqrt(Dh)  # (B, H, T, T)
    dq = dscores @ k  # (B, H, T, Dh)
    dk = jnp.swapaxes(dscores, -1, -2) @ q  # (B, H, T, Dh)
    # q, k, v = split_heads(x @ w + b): the three projections read x, so their dx add
    d_q, dx_q = linear_bwd(LinearRes(x, wq), merge_heads(dq))  # dx_q (B, T, D)
    d_k, dx_k = linear_bwd(LinearRes(x, wk), merge_heads(dk))  # dx_k (B, T, D)
    d_v, dx_v = linear_bwd(LinearRes(x, wv), merge_heads(dv))  # dx_v (B, T, D)
    dp = {"wq": d_q["w"], "bq": d_q["b"], "wk": d_k["w"], "bk": d_k["b"],
          "wv": d_v["w"], "bv": d_v["b"], "wo": d_out["w"], "bo": d_out["b"]}
    return dp, dx_q + dx_k + dx_v
