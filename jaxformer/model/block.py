"""The residual block in its four layouts (config.norm):

    pre:      x1 = x + drop(attn(ln1(x)));             y = x1 + drop(ffn(ln2(x1)))
    post:     x1 = ln1(x + drop(attn(x)));             y = ln2(x1 + drop(ffn(x1)))
    output:   x1 = x + drop(ln1_post(attn(x)));        y = x1 + drop(ln2_post(ffn(x1)))        (OLMo 2)
    sandwich: x1 = x + drop(ln1_post(attn(ln1(x))));   y = x1 + drop(ln2_post(ffn(ln2(x1))))  (Gemma 2, 3)

ln1 and ln2 are the norms on a sublayer's input (pre, sandwich) or after the residual sum
(post); ln1_post and ln2_post those on the attention's and the feed-forward's output. Every
layout but post ends the model with a final norm ln_f (transformer.py).

ln is layer norm, or RMS norm with config.norm_type "rms" (``pick_norm``; with
config.norm_offset its scale applied as (norm_offset + w)). ffn is
mlp.py's feed-forward, plain act(x w_in) w_out or with config.mlp "gated"
(act(x w_gate) * x w_up) w_down (SwiGLU with activation silu). drop is dropout at
config.dropout, only with a key (the layer's, dropout.layer_key); attention then drops
its probabilities too (dropout.py names every key).

``compose_block`` is the one place the block's forward is written. A path that needs
the block with a piece of its own passes the pieces in a ``BlockLayers``: the cached
decoder (kv_cache.py) an attention over its key/value cache, a custom model its own
attention kernel or feed-forward; ``BLOCK_LAYERS`` are the model's. The hand-derived
backward's mirror of this composition is manual_grads/block.py.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax

from jaxformer.model.attention import attention
from jaxformer.model.config import ModelConfig
from jaxformer.model.dropout import ATTN_OUT, ATTN_PROBS, FFN_OUT, active, dropout, sub_key
from jaxformer.model.layer_norm import layer_norm
from jaxformer.model.mlp import feed_forward
from jaxformer.model.moe import ffn_output
from jaxformer.model.moe_parallel import moe_layer
from jaxformer.model.rms_norm import rms_norm


class BlockLayers(NamedTuple):
    """The layers a block is composed of, each called with one layer's slice of params."""

    attention: Callable  # (p["attn"], x (B, T, D), config[, key]) -> (y (B, T, D), aux): aux comes back out
    feed_forward: Callable  # (p["ffn"], x (B, T, D), config) -> y (B, T, D)
    layer_norm: Callable  # (p["ln1"] or p["ln2"], x (B, T, D), eps) -> y (B, T, D)
    rms_norm: Callable = rms_norm  # the same, for norm_type "rms"


def pick_norm(layers, config: ModelConfig) -> Callable:
    """The norm config.norm_type names, from ``layers`` (a BlockLayers or ModelLayers), called
    (p, x, eps); an RMS norm's scale as (config.norm_offset + w) where norm_offset is set."""
    if config.norm_type != "rms":
        return layers.layer_norm
    if config.norm_offset:
        return lambda p, x, eps: layers.rms_norm(p, x, eps, config.norm_offset)
    return layers.rms_norm


def input_norms(config: ModelConfig) -> bool:
    """Whether the layout norms each sublayer's input (ln1, ln2 before attn, ffn): pre, sandwich."""
    return config.norm in ("pre", "sandwich")


def output_norms(config: ModelConfig) -> bool:
    """Whether the layout norms each sublayer's output (ln1_post, ln2_post): output, sandwich."""
    return config.norm in ("output", "sandwich")


def model_attention(p, x, config: ModelConfig, key=None, segments=None):
    """attention with the core config.attention_impl names, and no aux: (y, None).
    ``key``: the probabilities' dropout key (None: no dropout); ``segments`` (B, T): document ids."""
    return attention(p, x, config, key, segments=segments), None


def model_feed_forward(p, x, config: ModelConfig):
    """feed_forward with config's activation and compute dtype; with n_experts the MoE layer,
    (y, MoeStats)."""
    if config.n_experts:
        return moe_layer(p, x, config)
    return feed_forward(p, x, config.activation, config.compute_dtype)


BLOCK_LAYERS = BlockLayers(model_attention, model_feed_forward, layer_norm, rms_norm)


def compose_block(p, x, config: ModelConfig, layers: BlockLayers = BLOCK_LAYERS, key=None, segments=None):
    """One block of ``layers``; p is one layer's slice of params["blocks"]; x (B, T, D).
    ``key``: this layer's dropout key (None: no dropout; a key needs config.dropout > 0);
    ``segments`` (B, T): the attention's document ids, passed as its keyword where given.
    Returns (y (B, T, D), the aux that layers.attention returned beside its output); with
    n_experts the aux is (attention's aux, the MoE layer's MoeStats)."""
    attn, ffn = layers.attention, layers.feed_forward
    ln = pick_norm(layers, config)
    eps, rate = config.ln_eps, config.dropout
    if not active(rate, key):
        key = None
        attn_args = ()
    else:
        attn_args = (sub_key(key, ATTN_PROBS),)
    if segments is not None:
        attn = functools.partial(attn, segments=segments)
    drop_a = lambda y: dropout(y, rate, sub_key(key, ATTN_OUT))  # noqa: E731
    drop_f = lambda y: dropout(y, rate, sub_key(key, FFN_OUT))  # noqa: E731
    if config.norm == "pre":
        a, aux = attn(p["attn"], ln(p["ln1"], x, eps), config, *attn_args)
        x = x + drop_a(a)
        f, stats = ffn_output(ffn(p["ffn"], ln(p["ln2"], x, eps), config), config)
        x = x + drop_f(f)
    elif config.norm != "post":  # output, sandwich: the sublayers' outputs normed, inputs with sandwich
        inp = input_norms(config)
        a, aux = attn(p["attn"], ln(p["ln1"], x, eps) if inp else x, config, *attn_args)
        x = x + drop_a(ln(p["ln1_post"], a, eps))
        f, stats = ffn_output(ffn(p["ffn"], ln(p["ln2"], x, eps) if inp else x, config), config)
        x = x + drop_f(ln(p["ln2_post"], f, eps))
    else:
        a, aux = attn(p["attn"], x, config, *attn_args)
        x = ln(p["ln1"], x + drop_a(a), eps)
        f, stats = ffn_output(ffn(p["ffn"], x, config), config)
        x = ln(p["ln2"], x + drop_f(f), eps)
    return x, ((aux, stats) if config.n_experts else aux)


def block(p, x, config: ModelConfig, layers: BlockLayers = BLOCK_LAYERS, key=None, segments=None):
    """One transformer block. p is one layer's slice of params["blocks"]; x (B, T, D) -> (B, T, D).
    ``key``: the layer's dropout key, or None; ``segments`` (B, T): document ids, or None.
    With n_experts: (y, MoeStats)."""
    y, aux = compose_block(p, x, config, layers, key, segments)
    return (y, aux[1]) if config.n_experts else y


def remat_block(p, x, config: ModelConfig, key=None, segments=None):
    """block under ``jax.checkpoint`` (remat "block"): JAX's grad keeps only (p, x, key) and
    recomputes the block's forward (the same dropout masks) in the backward."""
    return jax.checkpoint(lambda p, x, key, s: block(p, x, config, key=key, segments=s))(p, x, key, segments)
