"""The feed-forward layer and the residual block, pre-LN and post-LN.

    pre:  x1 = x + attn(ln1(x));   y = x1 + ffn(ln2(x1))
    post: x1 = ln1(x + attn(x));   y = ln2(x1 + ffn(x1))

Where a value feeds both a residual branch and the skip connection, the two
gradients add. The residual's type (PreBlockRes or PostBlockRes) tells the
backward which block it undoes.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxformer.model.config import ModelConfig
from manual_grads.activations import (GeluRes, GeluTanhRes, ReluRes, TanhRes,
                                      activation_bwd, activation_fwd)
from manual_grads.attention import AttentionRes
from manual_grads.blockwise import BlockwiseAttentionRes, any_attention_bwd, any_attention_fwd
from manual_grads.layer_norm import LayerNormRes, layer_norm_bwd, layer_norm_fwd
from manual_grads.linear import LinearRes, linear_bwd, linear_fwd

# ----------------------------------------------------------------------------
# feed-forward: y = act(x @ w_in + b_in) @ w_out + b_out


class FeedForwardRes(NamedTuple):
    inp: LinearRes  # x (..., D), w_in (D, F)
    act: GeluRes | GeluTanhRes | ReluRes | TanhRes  # (..., F): h or act(h)
    out: LinearRes  # act(h) (..., F), w_out (F, D)


def feed_forward_fwd(p, x, activation_name, compute_dtype=None):
    """p = {w_in (D, F), b_in (F,), w_out (F, D), b_out (D,)}; x (..., D) -> y (..., D).
    The products run in ``compute_dtype``, the activation in float32 or wider."""
    h, inp_res = linear_fwd({"w": p["w_in"], "b": p["b_in"]}, x, compute_dtype)  # (..., F)
    a, act_res = activation_fwd(activation_name, h)  # (..., F)
    y, out_res = linear_fwd({"w": p["w_out"], "b": p["b_out"]}, a, compute_dtype)  # (..., D)
    return y, FeedForwardRes(inp_res, act_res, out_res)


def feed_forward_bwd(res: FeedForwardRes, dy):
    """dy (..., D) -> (dp with p's keys, dx (..., D))."""
    d_out, da = linear_bwd(res.out, dy)  # y = a @ w_out + b_out
    dh = activation_bwd(res.act, da)  # a = act(h)
    d_in, dx = linear_bwd(res.inp, dh)  # h = x @ w_in + b_in
    dp = {"w_in": d_in["w"], "b_in": d_in["b"], "w_out": d_out["w"], "b_out": d_out["b"]}
    return dp, dx


# ----------------------------------------------------------------------------
# the residual block


class PreBlockRes(NamedTuple):
    ln1: LayerNormRes  # of x (B, T, D)
    attn: AttentionRes | BlockwiseAttentionRes  # of ln1(x)
    ln2: LayerNormRes  # of x1 = x + attn(ln1(x)) (B, T, D)
    ffn: FeedForwardRes  # of ln2(x1)


class PostBlockRes(NamedTuple):
    attn: AttentionRes | BlockwiseAttentionRes  # of x (B, T, D)
    ln1: LayerNormRes  # of x + attn(x) (B, T, D)
    ffn: FeedForwardRes  # of x1 = ln1(x + attn(x))
    ln2: LayerNormRes  # of x1 + ffn(x1) (B, T, D)


def block_fwd(p, x, config: ModelConfig):
    """One block; p is one layer's slice of params["blocks"]; x (B, T, D) -> y (B, T, D)."""
    if config.norm == "pre":
        return pre_block_fwd(p, x, config)
    return post_block_fwd(p, x, config)


def block_bwd(res, dy):
    """dy (B, T, D) -> (dp with p's tree structure, dx (B, T, D))."""
    if isinstance(res, PreBlockRes):
        return pre_block_bwd(res, dy)
    return post_block_bwd(res, dy)


def pre_block_fwd(p, x, config: ModelConfig):
    eps, act, cd = config.ln_eps, config.activation, config.compute_dtype
    h1, ln1_res = layer_norm_fwd(p["ln1"], x, eps)  # (B, T, D)
    a, attn_res = any_attention_fwd(p["attn"], h1, config)  # (B, T, D)
    x1 = x + a  # (B, T, D)
    h2, ln2_res = layer_norm_fwd(p["ln2"], x1, eps)  # (B, T, D)
    f, ffn_res = feed_forward_fwd(p["ffn"], h2, act, cd)  # (B, T, D)
    return x1 + f, PreBlockRes(ln1_res, attn_res, ln2_res, ffn_res)


def pre_block_bwd(res: PreBlockRes, dy):
    # y = x1 + ffn(ln2(x1)): x1 gets dy through the skip and through the branch
    d_ffn, dh2 = feed_forward_bwd(res.ffn, dy)
    d_ln2, dx1_branch = layer_norm_bwd(res.ln2, dh2)
    dx1 = dy + dx1_branch
    # x1 = x + attn(ln1(x))
    d_attn, dh1 = any_attention_bwd(res.attn, dx1)
    d_ln1, dx_branch = layer_norm_bwd(res.ln1, dh1)
    dx = dx1 + dx_branch
    return {"ln1": d_ln1, "attn": d_attn, "ln2": d_ln2, "ffn": d_ffn}, dx


def post_block_fwd(p, x, config: ModelConfig):
    eps, act, cd = config.ln_eps, config.activation, config.compute_dtype
    a, attn_res = any_attention_fwd(p["attn"], x, config)  # (B, T, D)
    x1, ln1_res = layer_norm_fwd(p["ln1"], x + a, eps)  # (B, T, D)
    f, ffn_res = feed_forward_fwd(p["ffn"], x1, act, cd)  # (B, T, D)
    y, ln2_res = layer_norm_fwd(p["ln2"], x1 + f, eps)  # (B, T, D)
    return y, PostBlockRes(attn_res, ln1_res, ffn_res, ln2_res)


def post_block_bwd(res: PostBlockRes, dy):
    # y = ln2(x1 + ffn(x1)): x1 gets ds2 through the skip and through the branch
    d_ln2, ds2 = layer_norm_bwd(res.ln2, dy)
    d_ffn, dx1_branch = feed_forward_bwd(res.ffn, ds2)
    dx1 = ds2 + dx1_branch
    # x1 = ln1(x + attn(x))
    d_ln1, ds1 = layer_norm_bwd(res.ln1, dx1)
    d_attn, dx_branch = any_attention_bwd(res.attn, ds1)
    dx = ds1 + dx_branch
    return {"ln1": d_ln1, "attn": d_attn, "ln2": d_ln2, "ffn": d_ffn}, dx
