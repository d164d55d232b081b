"""Multi-head scaled dot-product attention with q/k/v/out projections.

Forward, per head h (columns h*Dh:(h+1)*Dh of the projections):
    q, k, v = split_qkv(x @ [wq | wk | wv] + [bq | bk | bv])   (B, H, T, Dh) each, one product
    S = q k^T / sqrt(Dh)                                   (B, H, T, T), future masked if causal
    P = softmax(S)                                         (B, H, T, T)
    Pd = drop(P)                                           (B, H, T, T), only with a dropout key
    y = merge_heads(Pd v) @ wo + bo                        (B, T, D)
With bias=False there are no b* leaves and no bias gradients. The dropout mask is not
kept: the backward redraws it from the key (manual_grads/dropout.py).

Mixed precision: x, q, k, v are kept in the compute dtype (the matmul inputs the
forward used), the probabilities in float32; the backward's products run in the
dtype of q with float32 accumulation.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.attention import (attention_probs, merge_heads, merge_qkv, qkv_heads,
                                       qkv_weights, split_heads)
from jaxformer.model.precision import cast, matmul
from manual_grads.dropout import DropoutRes, dropout_bwd, dropout_fwd
from manual_grads.linear import LinearRes, backward_dtype, linear_bwd, linear_fwd


class QKVRes(NamedTuple):
    x: jax.Array  # (B, T, D) the input of the q, k, v projections, in the compute dtype
    wq: jax.Array  # (D, D)
    wk: jax.Array  # (D, D)
    wv: jax.Array  # (D, D)
    b: jax.Array | None = None  # (3D,) [bq | bk | bv], None without biases


def qkv_fwd(p, x, n_heads, compute_dtype=None):
    """p = {wq, bq, wk, bk, wv, bv, ...}; x (B, T, D) -> (q, k, v) (B, H, T, Dh) each."""
    q, k, v = qkv_heads(p, x, n_heads, compute_dtype)  # (B, H, T, Dh) each
    return (q, k, v), QKVRes(cast(x, compute_dtype), p["wq"], p["wk"], p["wv"], qkv_weights(p)[1])


def qkv_bwd(res: QKVRes, dq, dk, dv):
    """dq, dk, dv (B, H, T, Dh) -> ({wq, bq, wk, bk, wv, bv}, dx (B, T, D)).

    Undoes ``q, k, v = split_qkv(x @ [wq | wk | wv] + [bq | bk | bv])`` as one linear
    layer of width 3D: one product for the three weight gradients over the B*T rows,
    one for dx; the gradients are then cut back into the three projections' leaves."""
    x, wq, wk, wv, b = res
    w = jnp.concatenate([wq, wk, wv], axis=1)  # (D, 3D)
    d, dx = linear_bwd(LinearRes(x, w, b), merge_qkv(dq, dk, dv))  # dx (B, T, D)
    dw = jnp.split(d["w"], 3, axis=1)  # (D, D) each
    dp = {"wq": dw[0], "wk": dw[1], "wv": dw[2]}
    if b is not None:
        db = jnp.split(d["b"], 3)  # (D,) each
        dp.update(bq=db[0], bk=db[1], bv=db[2])
    return dp, dx


class AttentionRes(NamedTuple):
    qkv: QKVRes  # x (B, T, D), wq, wk, wv (D, D)
    q: jax.Array  # (B, H, T, Dh) in the compute dtype, as are k and v
    k: jax.Array  # (B, H, T, Dh)
    v: jax.Array  # (B, H, T, Dh)
    probs: jax.Array  # (B, H, T, T) softmax of the scores (float32 or wider); 0 where masked; undropped
    out: LinearRes  # the output projection's: x = merge_heads(Pd @ v) (B, T, D), w = wo (D, D)
    drop: DropoutRes | None = None  # the probabilities' dropout key and rate; None: no dropout


def _proj(p, name):
    return {"w": p["w" + name], "b": p["b" + name]} if "b" + name in p else {"w": p["w" + name]}


def with_biases(dp, d_out):
    """The attention's gradient dict: dp (q, k, v) plus wo, and bo when the layer has biases."""
    dp = {**dp, "wo": d_out["w"]}
    if "b" in d_out:
        dp["bo"] = d_out["b"]
    return dp


def attention_fwd(p, x, n_heads, causal, compute_dtype=None, dropout_rate=0.0, key=None):
    """p = {wq, bq, wk, bk, wv, bv, wo, bo}; x (B, T, D) -> y (B, T, D).
    With a ``key`` the probabilities go through dropout at ``dropout_rate``."""
    cd = compute_dtype
    (q, k, v), qkv_res = qkv_fwd(p, x, n_heads, cd)  # (B, H, T, Dh) each
    probs = attention_probs(q, k, causal, cd)  # (B, H, T, T)
    dropped, drop_res = dropout_fwd(probs, dropout_rate, key)  # (B, H, T, T)
    y, out_res = linear_fwd(_proj(p, "o"), merge_heads(matmul(dropped, v, cd)), cd)  # (B, T, D)
    q, k, v = (cast(a, cd) for a in (q, k, v))  # what the products read
    return y, AttentionRes(qkv_res, q, k, v, probs, out_res, drop_res)


def softmax_bwd(probs, dprobs):
    """Undoes ``P = softmax(S)`` along the last axis: dS = P * (dP - rowsum(dP * P)).
    Masked scores have P = 0, so they get dS = 0; the max subtracted for
    stability cancels out of the softmax and gets no gradient."""
    return probs * (dprobs - jnp.sum(dprobs * probs, axis=-1, keepdims=True))


def attention_bwd(res: AttentionRes, dy):
    """dy (B, T, D) -> (dp with p's keys, dx (B, T, D))."""
    qkv_res, q, k, v, probs, out_res, drop_res = res
    H, Dh = q.shape[1], q.shape[-1]
    cd = backward_dtype(q, out_res.w)
    # y = merge_heads(Pd @ v) @ wo + bo
    d_out, datt = linear_bwd(out_res, dy)  # datt (B, T, D)
    datt = split_heads(datt, H)  # (B, H, T, Dh)
    # att = Pd @ v
    dropped = dropout_bwd(drop_res, probs)  # (B, H, T, T): Pd, the mask redrawn from the key
    dpd = matmul(datt, jnp.swapaxes(v, -1, -2), cd)  # (B, H, T, T)
    dv = matmul(jnp.swapaxes(dropped, -1, -2), datt, cd)  # (B, H, T, Dh)
    # Pd = drop(probs)
    dprobs = dropout_bwd(drop_res, dpd)  # (B, H, T, T)
    # probs = softmax(S), S = q k^T / sqrt(Dh): dS = softmax_bwd(probs, dprobs) / sqrt(Dh),
    # the 1 / sqrt(Dh) applied to the (B, H, T, Dh) products, not to the (B, H, T, T) dS
    dsm = softmax_bwd(probs, dprobs)  # (B, H, T, T): sqrt(Dh) * dS
    dq = matmul(dsm, k, cd) / math.sqrt(Dh)  # (B, H, T, Dh)
    dk = matmul(jnp.swapaxes(dsm, -1, -2), q, cd) / math.sqrt(Dh)  # (B, H, T, Dh)
    # q, k, v = split_qkv(x @ [wq | wk | wv] + [bq | bk | bv])
    dp, dx = qkv_bwd(qkv_res, dq, dk, dv)  # dx (B, T, D)
    return with_biases(dp, d_out), dx
