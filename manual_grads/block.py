"""The residual block in its four layouts (jaxformer/model/block.py):

    pre:      x1 = x + drop(attn(ln1(x)));             y = x1 + drop(ffn(ln2(x1)))
    post:     x1 = ln1(x + drop(attn(x)));             y = ln2(x1 + drop(ffn(x1)))
    output:   x1 = x + drop(ln1_post(attn(x)));        y = x1 + drop(ln2_post(ffn(x1)))
    sandwich: x1 = x + drop(ln1_post(attn(ln1(x))));   y = x1 + drop(ln2_post(ffn(ln2(x1))))

pre, output and sandwich share one pair (``pre_block_fwd``, ``pre_block_bwd``): a norm that
the layout lacks keeps None in PreBlockRes and its step is skipped both ways.
ln is layer norm, or RMS norm with norm_type "rms" (``norm_fwd``, the scale offset by
norm_offset; the backward follows the residual's type). ffn is mlp.py's pair, plain or gated. drop is dropout, only with
the layer's key (jaxformer/model/dropout.py names the keys); the residuals keep the keys
and redraw each mask in the backward.

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

from jaxformer.model.block import input_norms, output_norms
from jaxformer.model.config import ModelConfig
from jaxformer.model.dropout import ATTN_OUT, ATTN_PROBS, FFN_OUT, active, sub_key
from manual_grads.attention import AttentionRes, attention_bwd, attention_fwd
from manual_grads.dropout import DropoutRes, dropout_bwd, dropout_fwd
from manual_grads.layer_norm import LayerNormRes, layer_norm_bwd, layer_norm_fwd
from manual_grads.mlp import FeedForwardRes, GatedFeedForwardRes
from manual_grads.moe import MoeRes
from manual_grads.moe_parallel import ffn_bwd, ffn_fwd
from manual_grads.rms_norm import RMSNormRes, rms_norm_bwd, rms_norm_fwd
from manual_grads.tap import tap_backward, tap_forward

# ----------------------------------------------------------------------------
# the norm: layer norm or RMS norm, as config.norm_type says


def norm_fwd(p, x, config: ModelConfig):
    """The norm config.norm_type names (the model's ``pick_norm``): x (..., D) -> y, res."""
    if config.norm_type == "rms":
        return rms_norm_fwd(p, x, config.ln_eps, config.norm_offset)
    return layer_norm_fwd(p, x, config.ln_eps)


def norm_bwd(res, dy):
    """Undoes whichever norm made ``res``: dy (..., D) -> (dp, dx)."""
    if isinstance(res, RMSNormRes):
        return rms_norm_bwd(res, dy)
    return layer_norm_bwd(res, dy)

# ----------------------------------------------------------------------------
# the residual block


class PreBlockRes(NamedTuple):
    ln1: LayerNormRes | RMSNormRes | None  # of x (B, T, D); None: no input norms (output)
    attn: AttentionRes  # of ln1(x)
    ln2: LayerNormRes | RMSNormRes | None  # of x1 = x + attn(ln1(x)) (B, T, D); None as ln1
    ffn: FeedForwardRes | GatedFeedForwardRes | MoeRes  # of ln2(x1)
    drop_attn: DropoutRes | None = None  # the attention branch's dropout key; None: no dropout
    drop_ffn: DropoutRes | None = None  # the feed-forward branch's
    ln1_post: LayerNormRes | RMSNormRes | None = None  # of attn(...) (output, sandwich); None: pre
    ln2_post: LayerNormRes | RMSNormRes | None = None  # of ffn(...)


class PostBlockRes(NamedTuple):
    attn: AttentionRes  # of x (B, T, D)
    ln1: LayerNormRes | RMSNormRes  # of x + attn(x) (B, T, D)
    ffn: FeedForwardRes | GatedFeedForwardRes | MoeRes  # of x1 = ln1(x + attn(x))
    ln2: LayerNormRes | RMSNormRes  # of x1 + ffn(x1) (B, T, D)
    drop_attn: DropoutRes | None = None  # the attention branch's dropout key; None: no dropout
    drop_ffn: DropoutRes | None = None  # the feed-forward branch's


def block_fwd(p, x, config: ModelConfig, tap=None, key=None, segments=None):
    """One block; p is one layer's slice of params["blocks"]; x (B, T, D) -> y (B, T, D).
    ``tap`` (tap.py) sees each stage: ln1, attn, attn residual, ln2, ffn, ffn residual.
    ``key``: the layer's dropout key (None: no dropout); ``segments`` (B, T): the attention's
    document ids (None: one document a row). With n_experts y is (y, MoeStats)."""
    y, res = (post_block_fwd if config.norm == "post" else pre_block_fwd)(p, x, config, tap, key, segments)
    return ((y, res.ffn.stats) if config.n_experts else y), res


def _branch_keys(config: ModelConfig, key):
    """(attention probabilities', attention branch's, feed-forward branch's) dropout keys."""
    if not active(config.dropout, key):
        return None, None, None
    return sub_key(key, ATTN_PROBS), sub_key(key, ATTN_OUT), sub_key(key, FFN_OUT)


def block_bwd(res, dy, tap=None):
    """dy (B, T, D) -> (dp with p's tree structure, dx (B, T, D)); ``tap`` sees each stage.
    With n_experts dy is (dy, dstats): the statistics' cotangents join the MoE residual."""
    if isinstance(dy, tuple):
        dy, dstats = dy
        res = res._replace(ffn=res.ffn._replace(dstats=dstats))
    if isinstance(res, PreBlockRes):
        return pre_block_bwd(res, dy, tap)
    return post_block_bwd(res, dy, tap)


def _in_norm_fwd(p, name, x, config: ModelConfig, tap):
    """ln1 or ln2 on a sublayer's input where the layout has them: (h, res or None)."""
    if not input_norms(config):
        return x, None
    h, res = norm_fwd(p[name], x, config)  # (B, T, D)
    tap_forward(tap, name, x, h, p[name])
    return h, res


def _branch_fwd(p, name, y, config: ModelConfig, key, tap, stage, x_in, p_stage):
    """A sublayer's output y (B, T, D) -> (what the residual adds, ln_post res or None, dropout res):
    drop(y), tapped as ``stage`` (pre), or drop(p[name](y)) where the
    layout norms the outputs, ``stage`` tapped before the norm."""
    if not output_norms(config):
        y, drop = dropout_fwd(y, config.dropout, key)  # (B, T, D)
        tap_forward(tap, stage, x_in, y, p_stage)
        return y, None, drop
    tap_forward(tap, stage, x_in, y, p_stage)
    h, res = norm_fwd(p[name], y, config)  # (B, T, D)
    tap_forward(tap, name, y, h, p[name])
    h, drop = dropout_fwd(h, config.dropout, key)  # (B, T, D)
    return h, res, drop


def _norm_bwd(res, name, dy, grads, tap):
    """Undoes an optional norm (res None: dy as it is), its gradient into grads[name]."""
    if res is None:
        return dy
    grads[name], dx = norm_bwd(res, dy)
    tap_backward(tap, name, dy, grads[name], dx)
    return dx


def _branch_bwd(norm_res, drop, name, dy, grads, tap):
    """Undoes _branch_fwd: dy (B, T, D) -> (the sublayer output's gradient, the dy its stage's tap sees)."""
    d = dropout_bwd(drop, dy)  # y = drop(y)
    if norm_res is None:
        return d, dy
    d = _norm_bwd(norm_res, name, d, grads, tap)  # y = ln_post(y)
    return d, d


def pre_block_fwd(p, x, config: ModelConfig, tap=None, key=None, segments=None):
    k_probs, k_attn, k_ffn = _branch_keys(config, key)
    h1, ln1_res = _in_norm_fwd(p, "ln1", x, config, tap)  # (B, T, D)
    a, attn_res = attention_fwd(p["attn"], h1, config, k_probs, segments)  # (B, T, D)
    a, ln1_post_res, drop_attn = _branch_fwd(p, "ln1_post", a, config, k_attn, tap, "attn", h1, p["attn"])
    x1 = x + a  # (B, T, D)
    tap_forward(tap, "attn residual", a, x1)
    h2, ln2_res = _in_norm_fwd(p, "ln2", x1, config, tap)  # (B, T, D)
    f, ffn_res = ffn_fwd(p["ffn"], h2, config)  # (B, T, D)
    f = f[0] if config.n_experts else f  # the MoE layer's statistics stay on ffn_res
    f, ln2_post_res, drop_ffn = _branch_fwd(p, "ln2_post", f, config, k_ffn, tap, "ffn", h2, p["ffn"])
    y = x1 + f  # (B, T, D)
    tap_forward(tap, "ffn residual", f, y)
    return y, PreBlockRes(ln1_res, attn_res, ln2_res, ffn_res, drop_attn, drop_ffn, ln1_post_res, ln2_post_res)


def pre_block_bwd(res: PreBlockRes, dy, tap=None):
    grads = {}
    # y = x1 + drop(ln2_post(ffn(ln2(x1)))): x1 gets dy through the skip and through the branch
    df, seen = _branch_bwd(res.ln2_post, res.drop_ffn, "ln2_post", dy, grads, tap)
    grads["ffn"], dh2 = ffn_bwd(res.ffn, df)
    tap_backward(tap, "ffn", seen, grads["ffn"], dh2)
    dx1_branch = _norm_bwd(res.ln2, "ln2", dh2, grads, tap)
    dx1 = dy + dx1_branch
    tap_backward(tap, "ffn residual", dx1_branch, None, dx1)
    # x1 = x + drop(ln1_post(attn(ln1(x))))
    da, seen = _branch_bwd(res.ln1_post, res.drop_attn, "ln1_post", dx1, grads, tap)
    grads["attn"], dh1 = attention_bwd(res.attn, da)
    tap_backward(tap, "attn", seen, grads["attn"], dh1)
    dx_branch = _norm_bwd(res.ln1, "ln1", dh1, grads, tap)
    dx = dx1 + dx_branch
    tap_backward(tap, "attn residual", dx_branch, None, dx)
    return grads, dx


def post_block_fwd(p, x, config: ModelConfig, tap=None, key=None, segments=None):
    rate = config.dropout
    k_probs, k_attn, k_ffn = _branch_keys(config, key)
    a, attn_res = attention_fwd(p["attn"], x, config, k_probs, segments)  # (B, T, D)
    a, drop_attn = dropout_fwd(a, rate, k_attn)  # (B, T, D)
    tap_forward(tap, "attn", x, a, p["attn"])
    s1 = x + a  # (B, T, D)
    tap_forward(tap, "attn residual", a, s1)
    x1, ln1_res = norm_fwd(p["ln1"], s1, config)  # (B, T, D)
    tap_forward(tap, "ln1", s1, x1, p["ln1"])
    f, ffn_res = ffn_fwd(p["ffn"], x1, config)  # (B, T, D)
    f = f[0] if config.n_experts else f  # the MoE layer's statistics stay on ffn_res
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
    d_ffn, dx1_branch = ffn_bwd(res.ffn, dropout_bwd(res.drop_ffn, ds2))
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
