"""The feed-forward layer and the residual block, pre-LN and post-LN.

    pre:  x1 = x + attn(ln1(x));   y = x1 + ffn(ln2(x1))
    post: x1 = ln1(x + attn(x));   y = ln2(x1 + ffn(x1))

``compose_block`` is the one place the block's forward is written. A path that needs
the block with a piece of its own passes the pieces in a ``BlockLayers``: the cached
decoder (kv_cache.py) an attention over its key/value cache, a custom model its own
attention kernel or feed-forward; ``BLOCK_LAYERS`` are the model's. The hand-derived
backward's mirror of this composition is manual_grads/block.py.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax

from jaxformer.model.activations import activation
from jaxformer.model.attention import attention, attention_options
from jaxformer.model.config import ModelConfig
from jaxformer.model.layer_norm import layer_norm
from jaxformer.model.linear import linear


def feed_forward(p, x, activation_name, compute_dtype=None):
    """p = {w_in (D, F), b_in (F,), w_out (F, D), b_out (D,)}; x (..., D) -> (..., D)."""
    h = linear(x, p["w_in"], p["b_in"], compute_dtype)
    return linear(activation(activation_name, h), p["w_out"], p["b_out"], compute_dtype)


class BlockLayers(NamedTuple):
    """The layers a block is composed of, each called with one layer's slice of params."""

    attention: Callable  # (p["attn"], x (B, T, D), config) -> (y (B, T, D), aux): aux comes back out
    feed_forward: Callable  # (p["ffn"], x (B, T, D), config) -> y (B, T, D)
    layer_norm: Callable  # (p["ln1"] or p["ln2"], x (B, T, D), eps) -> y (B, T, D)


def model_attention(p, x, config: ModelConfig):
    """The attention config.attention_impl names (full, blockwise, pallas, cudnn), with no aux: (y, None)."""
    y = attention(p, x, config.n_heads, config.causal, config.compute_dtype, **attention_options(config))
    return y, None


def model_feed_forward(p, x, config: ModelConfig):
    """feed_forward with config's activation and compute dtype."""
    return feed_forward(p, x, config.activation, config.compute_dtype)


BLOCK_LAYERS = BlockLayers(model_attention, model_feed_forward, layer_norm)


def compose_block(p, x, config: ModelConfig, layers: BlockLayers = BLOCK_LAYERS):
    """One block of ``layers``; p is one layer's slice of params["blocks"]; x (B, T, D).
    Returns (y (B, T, D), the aux that layers.attention returned beside its output)."""
    attn, ffn, ln = layers
    eps = config.ln_eps
    if config.norm == "pre":
        a, aux = attn(p["attn"], ln(p["ln1"], x, eps), config)
        x = x + a
        x = x + ffn(p["ffn"], ln(p["ln2"], x, eps), config)
    else:
        a, aux = attn(p["attn"], x, config)
        x = ln(p["ln1"], x + a, eps)
        x = ln(p["ln2"], x + ffn(p["ffn"], x, config), eps)
    return x, aux


def block(p, x, config: ModelConfig, layers: BlockLayers = BLOCK_LAYERS):
    """One transformer block. p is one layer's slice of params["blocks"]; x (B, T, D) -> (B, T, D)."""
    return compose_block(p, x, config, layers)[0]


def remat_block(p, x, config: ModelConfig):
    """block under ``jax.checkpoint`` (remat "block"): JAX's grad keeps only (p, x) and
    recomputes the block's forward in the backward."""
    return jax.checkpoint(block, static_argnums=(2,))(p, x, config)
