"""The feed-forward layer (plain or gated) and the residual block, pre-LN and post-LN.

    pre:  x1 = x + drop(attn(ln1(x)));   y = x1 + drop(ffn(ln2(x1)))
    post: x1 = ln1(x + drop(attn(x)));   y = ln2(x1 + drop(ffn(x1)))

ln is layer norm, or RMS norm with norm_type "rms" (``norm_fwd``; the backward follows
the residual's type). drop is dropout, only with the layer's key (jaxformer/model/dropout.py names the
keys); the residuals keep the keys and redraw each mask in the backward.

Where a value feeds both a residual branch and the skip connection, the two
gradients add. The residual's type (PreBlockRes or PostBlockRes) tells the
backward which block it undoes.

This is the one manual composition of the block (its forward's twin is
jaxformer/model/block.py's ``compose_block``): custom_vjp.py registers it as the
block's rule, remat.py scans it over the layers, and the diagnosis
(jaxformer/training/diagnose.py) watches it through the optional ``tap`` (tap.py),
which sees every stage's input, output, parameters and gradients.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.block import gate_up_weights
from jaxformer.model.config import ModelConfig
from jaxformer.model.dropout import ATTN_OUT, ATTN_PROBS, FFN_OUT, active, sub_key
from manual_grads.activations import activation_bwd, activation_fwd
from manual_grads.attention import AttentionRes, attention_bwd, attention_fwd
from manual_grads.dropout import DropoutRes, dropout_bwd, dropout_fwd
from manual_grads.layer_norm import LayerNormRes, layer_norm_bwd, layer_norm_fwd
from manual_grads.linear import LinearRes, linear_bwd, linear_fwd
from manual_grads.rms_norm import RMSNormRes, rms_norm_bwd, rms_norm_fwd
from manual_grads.tap import tap_backward, tap_forward

# ----------------------------------------------------------------------------
# the norm: layer norm or RMS norm, as config.norm_type says


def norm_fwd(p, x, config: ModelConfig):
    """The norm config.norm_type names (the model's ``pick_norm``): x (..., D) -> y, res."""
    if config.norm_type == "rms":
        return rms_norm_fwd(p, x, config.ln_eps)
    return layer_norm_fwd(p, x, config.ln_eps)


def norm_bwd(res, dy):
    """Undoes whichever norm made ``res``: dy (..., D) -> (dp, dx)."""
    if isinstance(res, RMSNormRes):
        return rms_norm_bwd(res, dy)
    return layer_norm_bwd(res, dy)

# ----------------------------------------------------------------------------
# feed-forward: y = act(x @ w_in + b_in) @ w_out + b_out


class FeedForwardRes(NamedTuple):
    inp: LinearRes  # x (..., D), w_in (D, F)
    act: NamedTuple  # (..., F): the activation's residual (manual_grads/activations.py)
    out: LinearRes  # act(h) (..., F), w_out (F, D)


class GatedFeedForwardRes(NamedTuple):
    inp: LinearRes  # x (..., D), [w_gate | w_up] (D, 2F)
    act: NamedTuple  # (..., F): the gate's activation's residual
    a: jax.Array  # (..., F) act(gate), float32 or wider
    up: jax.Array  # (..., F) x @ w_up + b_up
    out: LinearRes  # act(gate) * up (..., F), w_down (F, D)


def feed_forward_fwd(p, x, activation_name, compute_dtype=None):
    """p = {w_in (D, F), b_in (F,), w_out (F, D), b_out (D,)}; x (..., D) -> y (..., D).
    The products run in ``compute_dtype``, the activation in float32 or wider. A gated p
    (w_gate, w_up, w_down) runs gated_feed_forward_fwd."""
    if "w_gate" in p:
        return gated_feed_forward_fwd(p, x, activation_name, compute_dtype)
    h, inp_res = linear_fwd(_lin(p, "in"), x, compute_dtype)  # (..., F)
    a, act_res = activation_fwd(activation_name, h)  # (..., F)
    y, out_res = linear_fwd(_lin(p, "out"), a, compute_dtype)  # (..., D)
    return y, FeedForwardRes(inp_res, act_res, out_res)


def feed_forward_bwd(res, dy):
    """dy (..., D) -> (dp with p's keys, dx (..., D))."""
    if isinstance(res, GatedFeedForwardRes):
        return gated_feed_forward_bwd(res, dy)
    d_out, da = linear_bwd(res.out, dy)  # y = a @ w_out + b_out
    dh = activation_bwd(res.act, da)  # a = act(h)
    d_in, dx = linear_bwd(res.inp, dh)  # h = x @ w_in + b_in
    dp = {"w_in": d_in["w"], "w_out": d_out["w"]}
    if "b" in d_in:  # the layer has biases (ModelConfig.bias)
        dp.update(b_in=d_in["b"], b_out=d_out["b"])
    return dp, dx


def gated_feed_forward_fwd(p, x, activation_name, compute_dtype=None):
    """p = {w_gate, w_up (D, F), w_down (F, D), b_gate, b_up (F,), b_down (D,)}; x (..., D) ->
    y = (act(x @ w_gate + b_gate) * (x @ w_up + b_up)) @ w_down + b_down (..., D)."""
    w, b = gate_up_weights(p)  # (D, 2F), (2F,) or None
    gu, inp_res = linear_fwd({"w": w} if b is None else {"w": w, "b": b}, x, compute_dtype)  # (..., 2F)
    gate, up = jnp.split(gu, 2, axis=-1)  # (..., F) each
    a, act_res = activation_fwd(activation_name, gate)  # (..., F)
    y, out_res = linear_fwd(_lin(p, "down"), a * up, compute_dtype)  # (..., D)
    return y, GatedFeedForwardRes(inp_res, act_res, a, up, out_res)


def gated_feed_forward_bwd(res: GatedFeedForwardRes, dy):
    """dy (..., D) -> ({w_gate, w_up, w_down, b_gate?, b_up?, b_down?}, dx (..., D))."""
    d_out, dm = linear_bwd(res.out, dy)  # y = m @ w_down + b_down, m = a * up
    da, dup = dm * res.up, dm * res.a  # m = a * up
    dgate = activation_bwd(res.act, da)  # a = act(gate)
    d_in, dx = linear_bwd(res.inp, jnp.concatenate([dgate, dup], axis=-1))  # [gate | up] = x @ [w_gate | w_up] + b
    dw_gate, dw_up = jnp.split(d_in["w"], 2, axis=1)  # (D, F) each
    dp = {"w_gate": dw_gate, "w_up": dw_up, "w_down": d_out["w"]}
    if "b" in d_in:  # the layer has biases (ModelConfig.bias)
        db_gate, db_up = jnp.split(d_in["b"], 2)
        dp.update(b_gate=db_gate, b_up=db_up, b_down=d_out["b"])
    return dp, dx


def _lin(p, name):
    """The feed-forward's w_<name>, b_<name> as a linear layer's {"w", "b"?}."""
    return {"w": p["w_" + name], "b": p["b_" + name]} if "b_" + name in p else {"w": p["w_" + name]}


# ----------------------------------------------------------------------------
# the residual block


class PreBlockRes(NamedTuple):
    ln1: LayerNormRes | RMSNormRes  # of x (B, T, D)
    attn: AttentionRes  # of ln1(x)
    ln2: LayerNormRes | RMSNormRes  # of x1 = x + attn(ln1(x)) (B, T, D)
    ffn: FeedForwardRes | GatedFeedForwardRes  # of ln2(x1)
    drop_attn: DropoutRes | None = None  # the attention branch's dropout key; None: no dropout
    drop_ffn: DropoutRes | None = None  # the feed-forward branch's


class PostBlockRes(NamedTuple):
    attn: AttentionRes  # of x (B, T, D)
    ln1: LayerNormRes | RMSNormRes  # of x + attn(x) (B, T, D)
    ffn: FeedForwardRes | GatedFeedForwardRes  # of x1 = ln1(x + attn(x))
    ln2: LayerNormRes | RMSNormRes  # of x1 + ffn(x1) (B, T, D)
    drop_attn: DropoutRes | None = None  # the attention branch's dropout key; None: no dropout
    drop_ffn: DropoutRes | None = None  # the feed-forward branch's


def block_fwd(p, x, config: ModelConfig, tap=None, key=None):
    """One block; p is one layer's slice of params["blocks"]; x (B, T, D) -> y (B, T, D).
    ``tap`` (tap.py) sees each stage: ln1, attn, attn residual, ln2, ffn, ffn residual.
    ``key``: the layer's dropout key (None: no dropout)."""
    if config.norm == "pre":
        return pre_block_fwd(p, x, config, tap, key)
    return post_block_fwd(p, x, config, tap, key)


def _branch_keys(config: ModelConfig, key):
    """(attention probabilities', attention branch's, feed-forward branch's) dropout keys."""
    if not active(config.dropout, key):
        return None, None, None
    return sub_key(key, ATTN_PROBS), sub_key(key, ATTN_OUT), sub_key(key, FFN_OUT)


def block_bwd(res, dy, tap=None):
    """dy (B, T, D) -> (dp with p's tree structure, dx (B, T, D)); ``tap`` sees each stage."""
    if isinstance(res, PreBlockRes):
        return pre_block_bwd(res, dy, tap)
    return post_block_bwd(res, dy, tap)


def pre_block_fwd(p, x, config: ModelConfig, tap=None, key=None):
    act, cd, rate = config.activation, config.compute_dtype, config.dropout
    k_probs, k_attn, k_ffn = _branch_keys(config, key)
    h1, ln1_res = norm_fwd(p["ln1"], x, config)  # (B, T, D)
    tap_forward(tap, "ln1", x, h1, p["ln1"])
    a, attn_res = attention_fwd(p["attn"], h1, config, k_probs)  # (B, T, D)
    a, drop_attn = dropout_fwd(a, rate, k_attn)  # (B, T, D)
    tap_forward(tap, "attn", h1, a, p["attn"])
    x1 = x + a  # (B, T, D)
    tap_forward(tap, "attn residual", a, x1)
    h2, ln2_res = norm_fwd(p["ln2"], x1, config)  # (B, T, D)
    tap_forward(tap, "ln2", x1, h2, p["ln2"])
    f, ffn_res = feed_forward_fwd(p["ffn"], h2, act, cd)  # (B, T, D)
    f, drop_ffn = dropout_fwd(f, rate, k_ffn)  # (B, T, D)
    tap_forward(tap, "ffn", h2, f, p["ffn"])
    y = x1 + f  # (B, T, D)
    tap_forward(tap, "ffn residual", f, y)
    return y, PreBlockRes(ln1_res, attn_res, ln2_res, ffn_res, drop_attn, drop_ffn)


def pre_block_bwd(res: PreBlockRes, dy, tap=None):
    # y = x1 + drop(ffn(ln2(x1))): x1 gets dy through the skip and through the branch
    d_ffn, dh2 = feed_forward_bwd(res.ffn, dropout_bwd(res.drop_ffn, dy))
    tap_backward(tap, "ffn", dy, d_ffn, dh2)
    d_ln2, dx1_branch = norm_bwd(res.ln2, dh2)
    tap_backward(tap, "ln2", dh2, d_ln2, dx1_branch)
    dx1 = dy + dx1_branch
    tap_backward(tap, "ffn residual", dx1_branch, None, dx1)
    # x1 = x + drop(attn(ln1(x)))
    d_attn, dh1 = attention_bwd(res.attn, dropout_bwd(res.drop_attn, dx1))
    tap_backward(tap, "attn", dx1, d_attn, dh1)
    d_ln1, dx_branch = norm_bwd(res.ln1, dh1)
    tap_backward(tap, "ln1", dh1, d_ln1, dx_branch)
    dx = dx1 + dx_branch
    tap_backward(tap, "attn residual", dx_branch, None, dx)
    return {"ln1": d_ln1, "attn": d_attn, "ln2": d_ln2, "ffn": d_ffn}, dx


def post_block_fwd(p, x, config: ModelConfig, tap=None, key=None):
    act, cd, rate = config.activation, config.compute_dtype, config.dropout
    k_probs, k_attn, k_ffn = _branch_keys(config, key)
    a, attn_res = attention_fwd(p["attn"], x, config, k_probs)  # (B, T, D)
    a, drop_attn = dropout_fwd(a, rate, k_attn)  # (B, T, D)
    tap_forward(tap, "attn", x, a, p["attn"])
    s1 = x + a  # (B, T, D)
    tap_forward(tap, "attn residual", a, s1)
    x1, ln1_res = norm_fwd(p["ln1"], s1, config)  # (B, T, D)
    tap_forward(tap, "ln1", s1, x1, p["ln1"])
    f, ffn_res = feed_forward_fwd(p["ffn"], x1, act, cd)  # (B, T, D)
    f, drop_ffn = dropout_fwd(f, rate, k_ffn)  # (B, T, D)
    tap_forward(tap, "ffn", x1, f, p["ffn"])
    s2 = x1 + f  # (B, T, D)
    tap_forward(tap, "ffn residual", f, s2)
    y, ln2_res = norm_fwd(p["ln2"], s2, config)  # (B, T, D)
    tap_forward(tap, "ln2", s2, y, p["ln2"])
    return y, PostBlockRes(attn_res, ln1_res, ffn_res, ln2_res, drop_attn, drop_ffn)


def post_block_bwd(res: PostBlockRes, dy, tap=None):
    # y = ln2(x1 + drop(ffn(x1))): x1 gets ds2 through the skip and through the branch
    d_ln2, ds2 = norm_bwd(res.ln2, dy)
    tap_backward(tap, "ln2", dy, d_ln2, ds2)
    d_ffn, dx1_branch = feed_forward_bwd(res.ffn, dropout_bwd(res.drop_ffn, ds2))
    tap_backward(tap, "ffn", ds2, d_ffn, dx1_branch)
    dx1 = ds2 + dx1_branch
    tap_backward(tap, "ffn residual", dx1_branch, None, dx1)
    # x1 = ln1(x + drop(attn(x)))
    d_ln1, ds1 = norm_bwd(res.ln1, dx1)
    tap_backward(tap, "ln1", dx1, d_ln1, ds1)
    d_attn, dx_branch = attention_bwd(res.attn, dropout_bwd(res.drop_attn, ds1))
    tap_backward(tap, "attn", ds1, d_attn, dx_branch)
    dx = ds1 + dx_branch
    tap_backward(tap, "attn residual", dx_branch, None, dx)
    return {"ln1": d_ln1, "attn": d_attn, "ln2": d_ln2, "ffn": d_ffn}, dx
