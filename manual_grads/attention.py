"""Multi-head scaled dot-product attention with q/k/v/out projections.

Forward, per head h (columns h*Dh:(h+1)*Dh of the projections):
    q, k, v = split_qkv(x @ [wq | wk | wv] + [bq | bk | bv])   q (B, H, T, Dh), k, v (B, Hkv, T, Dh)
    q, k = rope(qk_norm(q), qk_norm(k))                    only where those options are on
    k, v = repeat_kv(k, G), repeat_kv(v, G)                (B, H, T, Dh), G = H / Hkv (grouped-query)
    S = q k^T / sqrt(Dh)                                   (B, H, T, T), future masked if causal
    P = softmax(S)                                         (B, H, T, T)
    Pd = drop(P)                                           (B, H, T, T), only with a dropout key
    y = merge_heads(Pd v) @ wo + bo                        (B, T, D)
With bias=False there are no b* leaves and no bias gradients. A key/value head read by
G query heads gets the sum of their gradients (``sum_groups`` undoes ``repeat_kv``). The dropout mask is not
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
                                       qkv_weights, repeat_kv, split_heads)
from jaxformer.model.precision import cast, matmul
from jaxformer.model.rotary import rope_tables
from manual_grads.dropout import DropoutRes, dropout_bwd, dropout_fwd
from manual_grads.linear import LinearRes, backward_dtype, linear_bwd, linear_fwd
from manual_grads.rms_norm import RMSNormRes, rms_norm_bwd, rms_norm_fwd
from manual_grads.rotary import RopeRes, rope_bwd, rope_fwd


class QKVRes(NamedTuple):
    x: jax.Array  # (B, T, D) the input of the q, k, v projections, in the compute dtype
    wq: jax.Array  # (D, D)
    wk: jax.Array  # (D, Hkv * Dh)
    wv: jax.Array  # (D, Hkv * Dh)
    b: jax.Array | None = None  # (D + 2 Hkv Dh,) [bq | bk | bv], None without biases


def qkv_fwd(p, x, n_heads, compute_dtype=None, n_kv_heads=0):
    """p = {wq, bq, wk, bk, wv, bv, ...}; x (B, T, D) -> (q (B, H, T, Dh), k, v (B, Hkv, T, Dh))."""
    q, k, v = qkv_heads(p, x, n_heads, compute_dtype, n_kv_heads)
    return (q, k, v), QKVRes(cast(x, compute_dtype), p["wq"], p["wk"], p["wv"], qkv_weights(p)[1])


def qkv_bwd(res: QKVRes, dq, dk, dv):
    """dq (B, H, T, Dh), dk, dv (B, Hkv, T, Dh) -> ({wq, bq, wk, bk, wv, bv}, dx (B, T, D)).
    Undoes ``q, k, v = split_qkv(x @ [wq | wk | wv] + [bq | bk | bv])`` as one linear
    layer of width D + 2 Hkv Dh: one product for the three weight gradients over the B*T
    rows, one for dx; the gradients are then cut back into the three projections' leaves."""
    x, wq, wk, wv, b = res
    w = jnp.concatenate([wq, wk, wv], axis=1)  # (D, D + 2 Hkv Dh)
    d, dx = linear_bwd(LinearRes(x, w, b), merge_qkv(dq, dk, dv))  # dx (B, T, D)
    cuts = [wq.shape[1], wq.shape[1] + wk.shape[1]]
    dw = jnp.split(d["w"], cuts, axis=1)  # (D, D), (D, Hkv Dh), (D, Hkv Dh)
    dp = {"wq": dw[0], "wk": dw[1], "wv": dw[2]}
    if b is not None:
        db = jnp.split(d["b"], cuts)
        dp.update(bq=db[0], bk=db[1], bv=db[2])
    return dp, dx


class RotateQKRes(NamedTuple):
    """What QK-norm and rotary positions keep; None where the option is off."""
    q_norm: RMSNormRes | None  # of q (B, H, T, Dh)
    k_norm: RMSNormRes | None  # of k (B, Hkv, T, Dh)
    rope: RopeRes | None  # the cos, sin tables (T, Dh)


def rotate_qk_fwd(p, q, k, norm_eps, rope_theta):
    """q (B, H, T, Dh), k (B, Hkv, T, Dh) -> (q, k), res: the model's ``rotate_qk``: an RMS
    norm over each head's width where p has q_norm and k_norm, then rotary positions
    where rope_theta > 0."""
    q_res = k_res = rope_res = None
    if "q_norm" in p:
        q, q_res = rms_norm_fwd(p["q_norm"], q, norm_eps)
        k, k_res = rms_norm_fwd(p["k_norm"], k, norm_eps)
    if rope_theta:
        cos, sin = rope_tables(jnp.arange(q.shape[-2]), q.shape[-1], rope_theta, q.dtype)  # (T, Dh)
        q, rope_res = rope_fwd(q, cos, sin)
        k, _ = rope_fwd(k, cos, sin)
    return (q, k), RotateQKRes(q_res, k_res, rope_res)


def rotate_qk_bwd(res: RotateQKRes, dq, dk):
    """dq, dk -> ({q_norm, k_norm} gradients where QK-norm is on, dq, dk)."""
    dp = {}
    if res.rope is not None:  # q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        dq, dk = rope_bwd(res.rope, dq), rope_bwd(res.rope, dk)
    if res.q_norm is not None:  # q, k = rms_norm(p["q_norm"], q, eps), rms_norm(p["k_norm"], k, eps)
        dp["q_norm"], dq = rms_norm_bwd(res.q_norm, dq)
        dp["k_norm"], dk = rms_norm_bwd(res.k_norm, dk)
    return dp, dq, dk


class HeadsRes(NamedTuple):
    qkv: QKVRes  # the projections' input and weights
    rotate: RotateQKRes  # QK-norm's and rotary positions' (None fields where off)


def heads_fwd(p, x, n_heads, compute_dtype=None, n_kv_heads=0, norm_eps=1e-5, rope_theta=0.0):
    """The model's ``attention_qkv``: x (B, T, D) -> (q (B, H, T, Dh), k, v (B, Hkv, T, Dh)):
    the projections, then QK-norm and rotary positions where they are on."""
    (q, k, v), qkv_res = qkv_fwd(p, x, n_heads, compute_dtype, n_kv_heads)
    (q, k), rot_res = rotate_qk_fwd(p, q, k, norm_eps, rope_theta)
    return (q, k, v), HeadsRes(qkv_res, rot_res)


def heads_bwd(res: HeadsRes, dq, dk, dv):
    """dq (B, H, T, Dh), dk, dv (B, Hkv, T, Dh) -> (the projections' and norms' dp, dx (B, T, D))."""
    d_rot, dq, dk = rotate_qk_bwd(res.rotate, dq, dk)  # q, k = rotate_qk(p, q, k)
    dp, dx = qkv_bwd(res.qkv, dq, dk, dv)  # q, k, v = split_qkv(x @ [wq | wk | wv] + b)
    return {**dp, **d_rot}, dx


def sum_groups(dx, n_kv_heads):
    """Undoes ``x = repeat_kv(x, G)``: (B, Hkv * G, T, Dh) -> (B, Hkv, T, Dh), each key/value
    head the sum of the G query heads' gradients that read it."""
    B, H, T, Dh = dx.shape
    return dx if H == n_kv_heads else dx.reshape(B, n_kv_heads, H // n_kv_heads, T, Dh).sum(axis=2)


def head_options(config) -> dict:
    """heads_fwd's keyword arguments a ModelConfig sets (model.attention.attention_options')."""
    return dict(n_kv_heads=config.kv_heads, norm_eps=config.ln_eps,
                rope_theta=config.rope_theta if config.positions == "rope" else 0.0)


class AttentionRes(NamedTuple):
    heads: HeadsRes  # x (B, T, D), wq, wk, wv; QK-norm's and rotary positions'
    q: jax.Array  # (B, H, T, Dh) in the compute dtype, as are k and v
    k: jax.Array  # (B, Hkv, T, Dh), before repeat_kv
    v: jax.Array  # (B, Hkv, T, Dh)
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


def attention_fwd(p, x, n_heads, causal, compute_dtype=None, dropout_rate=0.0, key=None,
                  n_kv_heads=0, norm_eps=1e-5, rope_theta=0.0):
    """p = {wq, bq, wk, bk, wv, bv, wo, bo, q_norm?, k_norm?}; x (B, T, D) -> y (B, T, D).
    With a ``key`` the probabilities go through dropout at ``dropout_rate``;
    n_kv_heads, norm_eps, rope_theta: the modern block's (``heads_fwd``)."""
    cd = compute_dtype
    (q, k, v), heads_res = heads_fwd(p, x, n_heads, cd, n_kv_heads, norm_eps, rope_theta)
    G = n_heads // k.shape[1]
    probs = attention_probs(q, repeat_kv(k, G), causal, cd)  # (B, H, T, T)
    dropped, drop_res = dropout_fwd(probs, dropout_rate, key)  # (B, H, T, T)
    att = matmul(dropped, repeat_kv(v, G), cd)  # (B, H, T, Dh)
    y, out_res = linear_fwd(_proj(p, "o"), merge_heads(att), cd)  # (B, T, D)
    q, k, v = (cast(a, cd) for a in (q, k, v))  # what the products read
    return y, AttentionRes(heads_res, q, k, v, probs, out_res, drop_res)


def softmax_bwd(probs, dprobs):
    """Undoes ``P = softmax(S)`` along the last axis: dS = P * (dP - rowsum(dP * P)).
    Masked scores have P = 0, so they get dS = 0; the max subtracted for
    stability cancels out of the softmax and gets no gradient."""
    return probs * (dprobs - jnp.sum(dprobs * probs, axis=-1, keepdims=True))


def attention_bwd(res: AttentionRes, dy):
    """dy (B, T, D) -> (dp with p's keys, dx (B, T, D))."""
    heads_res, q, k, v, probs, out_res, drop_res = res
    H, Hkv, Dh = q.shape[1], k.shape[1], q.shape[-1]
    k, v = repeat_kv(k, H // Hkv), repeat_kv(v, H // Hkv)  # (B, H, T, Dh): what the core read
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
    # k, v = repeat_kv(k, G), repeat_kv(v, G)
    dk, dv = sum_groups(dk, Hkv), sum_groups(dv, Hkv)  # (B, Hkv, T, Dh)
    # q, k, v = rotate_qk(split_qkv(x @ [wq | wk | wv] + [bq | bk | bv]))
    dp, dx = heads_bwd(heads_res, dq, dk, dv)  # dx (B, T, D)
    return with_biases(dp, d_out), dx
