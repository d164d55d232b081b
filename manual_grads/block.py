"""The residual block in its four layouts (jaxformer/model/block.py):

    pre:      x1 = x + drop(attn(ln1(x)));             y = x1 + drop(ffn(ln2(x1)))
    post:     x1 = ln1(x + drop(attn(x)));             y = ln2(x1 + drop(ffn(x1)))
    output:   x1 = x + drop(ln1_post(attn(x)));        y = x1 + drop(ln2_post(ffn(x1)))
    sandwich: x1 = x + drop(ln1_post(attn(ln1(x))));   y = x1 + drop(ln2_post(ffn(ln2(x1))))

pre, output and sandwich share one pair (``pre_block_fwd``, ``pre_block_bwd``): a norm that
the layout lacks keeps None in PreBlockRes and its step is skipped both ways.
ln is layer norm, or RMS norm with norm_type "rms" (norms.py's ``norm_fwd``, the scale offset by
norm_offset; the backward follows the residual's type; on a GPU Pallas kernels). ffn is mlp.py's pair, plain or gated. drop is dropout, only with
the layer's key (jaxformer/model/dropout.py names the keys); the residuals keep the keys
and redraw each mask in the backward.

Where a value feeds both a residual branch and the skip connection, the two
gradients add. The residual's type (PreBlockRes or PostBlockRes) tells the
backward which block it undoes.

In the pre layout (no dropout drawn on the attention's output, no LoRA on it, no tap) ln2's
forward also writes x1 (norms.add_norm_fwd: on a GPU one kernel reads x and the attention's
product and writes x1 = x + (a + bo) beside ln2's output); the attention leaves bo to it.

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
from jaxformer.model.lora import LORA
from manual_grads.attention import AttentionRes, attention_bwd, attention_fwd
from manual_grads.dropout import DropoutRes, dropout_bwd, dropout_fwd
from manual_grads.layer_norm import LayerNormRes
from manual_grads.linear import Cotangent, LinearRes, wide
from manual_grads.mlp import FeedForwardRes, GatedFeedForwardRes
from manual_grads.moe import MoeRes
from manual_grads.moe_parallel import ffn_bwd, ffn_fwd
from manual_grads.norms import add_norm_fwd, cotangent_feeds, norm_bwd, norm_fwd
from manual_grads.rms_norm import RMSNormRes
from manual_grads.tap import tap_backward, tap_forward

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


def with_dstats(res, dy):
    """A block's (res, dy): with n_experts dy is (dy, dstats), and the cotangents of the MoE
    layer's statistics join its residual (moe.py's backward reads them there)."""
    if not isinstance(dy, tuple) or isinstance(dy, Cotangent):
        return res, dy
    dy, dstats = dy
    return res._replace(ffn=res.ffn._replace(dstats=dstats)), dy


def block_bwd(res, dy, tap=None):
    """dy (B, T, D) -> (dp with p's tree structure, dx (B, T, D)); ``tap`` sees each stage.
    With n_experts dy is (dy, dstats): the statistics' cotangents join the MoE residual."""
    res, dy = with_dstats(res, dy)
    if isinstance(res, PreBlockRes):
        return pre_block_bwd(res, dy, tap)
    return post_block_bwd(res, dy, tap)


def _in_norm_fwd(p, name, x, config: ModelConfig, tap):
    """ln1 or ln2 on a sublayer's input where the layout has them: (h, res or None)."""
    if not input_norms(config):
        return x, None
    h, res = norm_fwd(p[name], x, config, _products_only(p, tap))  # (B, T, D)
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


def _products_only(p, tap) -> bool:
    """Whether only the sublayers' products read an input norm's output (not a LoRA adapter's
    dropout, nor a tap)."""
    return tap is None and not any(LORA in p[stage] for stage in ("attn", "ffn"))


def _add_in_norm(p, config: ModelConfig, tap, k_attn) -> bool:
    """Whether x1 = x + attention(...) is written by ln2's forward (norms.add_norm_fwd): the pre
    layout with the attention's output as it is (no dropout drawn on it, no LoRA on wo, no tap)."""
    return config.norm == "pre" and tap is None and k_attn is None and LORA not in p["attn"]


def pre_block_fwd(p, x, config: ModelConfig, tap=None, key=None, segments=None):
    k_probs, k_attn, k_ffn = _branch_keys(config, key)
    h1, ln1_res = _in_norm_fwd(p, "ln1", x, config, tap)  # (B, T, D)
    if _add_in_norm(p, config, tap, k_attn):  # one pass: the sum and its norm (a GPU's kernel)
        a, attn_res = attention_fwd(p["attn"], h1, config, k_probs, segments, out_bias=False)  # without bo
        h2, ln2_res, x1 = add_norm_fwd(p["ln2"], x, a, p["attn"].get("bo"), config, _products_only(p, tap))
        ln1_post_res = drop_attn = None  # x1 = x + (a + bo), h2 = ln2(x1): (B, T, D)
    else:
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
    """dy (B, T, D), or the Cotangent the norm above wrote for this block's feed-forward (then dx is
    one too, for the block below's) -> (grads, dx)."""
    grads = {}
    # y = x1 + drop(ln2_post(ffn(ln2(x1)))): x1 gets dy through the skip and through the branch
    dx1 = _sublayer_bwd(res, "ffn", ffn_bwd, "ln2", dy, grads, tap, _feeds(res, "attn", "ln1"))
    # x1 = x + drop(ln1_post(attn(ln1(x))))
    below = (None if dy.narrow is None else dy.narrow.dtype, dy.sums is not None) if isinstance(dy, Cotangent) else None
    dx = _sublayer_bwd(res, "attn", attention_bwd, "ln1", dx1, grads, tap, below)
    return grads, dx


def _feeds(res: PreBlockRes, stage, norm):
    """norms.norm_bwd's ``feeds`` for the norm backward whose dx is ``stage``'s output cotangent:
    what the stage's output projection reads of it (its narrow copy, its sums for the bias), or
    None where the stage reads dy as computed (dropout or a norm on the branch, a MoE layer)."""
    out = getattr(getattr(res, stage), "out", None) or getattr(getattr(res, stage), "out_res", None)
    if not isinstance(out, LinearRes) or getattr(res, f"{norm}_post") is not None or \
            getattr(res, f"drop_{stage}") is not None:
        return None
    return cotangent_feeds(out.x.dtype, out.b is not None)  # x is kept in the products' compute dtype


def top_feeds(config: ModelConfig, dtype, key=None, tap=None):
    """norms.norm_bwd's ``feeds`` for the final norm's backward, whose dx is the top block's
    output gradient: where every block is the pre layout's with a dense feed-forward, no dropout
    drawn and no tap, its output projection's (the blocks then pass a Cotangent down, each
    block's ln1 writing the one below's); else None (plain arrays throughout)."""
    if tap is not None or config.norm != "pre" or config.n_experts or active(config.dropout, key):
        return None
    return cotangent_feeds(config.compute_dtype, config.linear_biases.mlp, dtype)


def _sublayer_bwd(res: PreBlockRes, stage, stage_bwd, norm, dy, grads, tap, feeds=None):
    """Undoes one residual sublayer, y = x + drop(<norm>_post(<stage>(<norm>(x)))) (a norm the
    layout lacks is None in ``res``): dy (B, T, D) -> dx, the gradients into ``grads``. A Cotangent
    dy (norms.norm_bwd's): the stage's output projection reads its narrow copy and sums; ``feeds``:
    dx a Cotangent for the stage below (where the norm's backward runs fused with the skip)."""
    post, drop = getattr(res, f"{norm}_post"), getattr(res, f"drop_{stage}")
    if isinstance(dy, Cotangent) and post is None and drop is None and tap is None:
        d, seen = dy, dy.wide  # y = x + stage(...): the stage's output gradient is dy itself
    else:
        d, seen = _branch_bwd(post, drop, f"{norm}_post", wide(dy), grads, tap)
    dy = wide(dy)
    # without a tap, h = <norm>(x) and y = x + branch are undone in one pass (norms.py), which
    # reads dh in the products' dtype
    fused = tap is None and getattr(res, norm) is not None
    grads[stage], dh = stage_bwd(getattr(res, stage), d, narrow_ok=fused)  # <stage>(h)
    tap_backward(tap, stage, seen, grads[stage], dh)
    if fused:
        grads[norm], dx = norm_bwd(getattr(res, norm), dh, skip=dy, feeds=feeds)  # h = <norm>(x); y = x + branch
        return dx
    dx_branch = _norm_bwd(getattr(res, norm), norm, dh, grads, tap)  # h = <norm>(x)
    dx = dy + dx_branch  # y = x + branch: the skip's gradient and the branch's add
    tap_backward(tap, f"{stage} residual", dx_branch, None, dx)
    return dx


def post_block_fwd(p, x, config: ModelConfig, tap=None, key=None, segments=None):
    k_probs, k_attn, k_ffn = _branch_keys(config, key)
    a, attn_res = attention_fwd(p["attn"], x, config, k_probs, segments)  # (B, T, D)
    x1, ln1_res, drop_attn = _post_sublayer_fwd(p, "attn", "ln1", x, a, config, k_attn, tap)
    f, ffn_res = ffn_fwd(p["ffn"], x1, config)  # (B, T, D)
    f = f[0] if config.n_experts else f  # the MoE layer's statistics stay on ffn_res
    y, ln2_res, drop_ffn = _post_sublayer_fwd(p, "ffn", "ln2", x1, f, config, k_ffn, tap)
    return y, PostBlockRes(attn_res, ln1_res, ffn_res, ln2_res, drop_attn, drop_ffn)


def _post_sublayer_fwd(p, stage, norm, x, out, config: ModelConfig, key, tap):
    """The rest of one post-layout sublayer, y = <norm>(x + drop(out)) with out = <stage>(x)
    (B, T, D): (y, the norm's res, the dropout's res)."""
    out, drop = dropout_fwd(out, config.dropout, key)  # (B, T, D)
    tap_forward(tap, stage, x, out, p[stage])
    s = x + out  # (B, T, D)
    tap_forward(tap, f"{stage} residual", out, s)
    y, norm_res = norm_fwd(p[norm], s, config)  # (B, T, D)
    tap_forward(tap, norm, s, y, p[norm])
    return y, norm_res, drop


def post_block_bwd(res: PostBlockRes, dy, tap=None):
    # y = ln2(x1 + drop(ffn(x1))): x1 gets ds2 through the skip and through the branch
    d_ln2, d_ffn, dx1 = _post_sublayer_bwd(res.ln2, "ln2", res.drop_ffn, res.ffn, ffn_bwd, "ffn", dy, tap)
    # x1 = ln1(x + drop(attn(x)))
    d_ln1, d_attn, dx = _post_sublayer_bwd(res.ln1, "ln1", res.drop_attn, res.attn, attention_bwd, "attn", dx1, tap)
    return {"ln1": d_ln1, "attn": d_attn, "ln2": d_ln2, "ffn": d_ffn}, dx


def _post_sublayer_bwd(norm_res, norm, drop, stage_res, stage_bwd, stage, dy, tap):
    """Undoes one post-layout sublayer, y = <norm>(x + drop(<stage>(x))): dy (B, T, D) ->
    (the norm's gradients, the stage's, dx)."""
    d_norm, ds = norm_bwd(norm_res, dy)  # y = <norm>(s)
    tap_backward(tap, norm, dy, d_norm, ds)
    d_stage, dx_branch = stage_bwd(stage_res, dropout_bwd(drop, ds))  # s = x + drop(<stage>(x))
    tap_backward(tap, stage, ds, d_stage, dx_branch)
    dx = ds + dx_branch  # the skip's gradient and the branch's add
    tap_backward(tap, f"{stage} residual", dx_branch, None, dx)
    return d_norm, d_stage, dx
