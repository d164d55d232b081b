"""The whole model: features, forward(params, inputs, config) -> logits, and loss_fn.

    x = embed(inputs)                  (B, T, D)
    x = block_l(x), l = 0 .. L-1       lax.scan over params["blocks"]
    x = ln_f(x)                        pre-LN only
    logits = x @ head.w + head.b       (B, T, V)
    loss = cross_entropy(logits)       ()   (loss_chunk > 0: both, chunk by chunk)

This is the one place the sequence is written. Each function takes the layer
functions it composes as ``layers`` (a ``ModelLayers``), the model's by default;
manual_grads.custom_vjp passes its drop-ins, whose gradient is the hand-derived one.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax

from jaxformer.model.block import block, remat_block
from jaxformer.model.chunked_loss import chunked_head_loss
from jaxformer.model.config import ModelConfig
from jaxformer.model.embedding import embed
from jaxformer.model.layer_norm import layer_norm
from jaxformer.model.linear import linear
from jaxformer.model.losses import cross_entropy
from jaxformer.model.params import validate_params
from jaxformer.model.precision import upcast
from jaxformer.model.validate import check_precision, validate_batch, validate_tokens


class ModelLayers(NamedTuple):
    """The layer functions features, forward and loss_fn compose."""

    embed: Callable  # (params, inputs int (B, T), config) -> x (B, T, D)
    block: Callable  # (p, x (B, T, D), config) -> (B, T, D); p one layer's slice of params["blocks"]
    remat_block: Callable  # block keeping only (p, x) for its backward (remat "block")
    layer_norm: Callable  # (p, x, eps) -> (B, T, D): the final norm
    linear: Callable  # (x, w, b, compute_dtype) -> x @ w + b: the head
    cross_entropy: Callable  # (logits (B, T, V), targets, mask) -> ()
    chunked_head_loss: Callable  # (head, x (B, T, D), targets, mask, chunk, compute_dtype) -> ()


MODEL_LAYERS = ModelLayers(embed, block, remat_block, layer_norm, linear, cross_entropy,
                           chunked_head_loss)


def features(params, inputs, config: ModelConfig, layers: ModelLayers = MODEL_LAYERS):
    """inputs int (B, T) -> the head's input (B, T, D): embeddings, blocks, final norm.
    With remat "block" each scanned block is layers.remat_block (the model's: a
    jax.checkpoint, so JAX's grad keeps only its input and recomputes the rest)."""
    validate_tokens("inputs", inputs, config)
    validate_params(params, config)
    x = upcast(layers.embed(params, inputs, config))  # (B, T, D), float32 or wider: the residual stream
    layer = layers.remat_block if config.remat == "block" else layers.block
    x, _ = jax.lax.scan(lambda x, p: (layer(p, x, config), None), x, params["blocks"])
    if config.norm == "pre":
        x = layers.layer_norm(params["ln_f"], x, config.ln_eps)
    return x


def forward(params, inputs, config: ModelConfig, layers: ModelLayers = MODEL_LAYERS):
    """inputs int (B, T) -> logits (B, T, V), in the dtype of the params (float32 when
    config.compute_dtype puts the matmuls of float32 params in bfloat16)."""
    x = features(params, inputs, config, layers)  # (B, T, D)
    return layers.linear(x, params["head"]["w"], params["head"]["b"], config.compute_dtype)  # (B, T, V)


def loss_fn(params, batch, config: ModelConfig, layers: ModelLayers = MODEL_LAYERS):
    """Mean next-token cross entropy of ``batch`` = {"inputs", "targets", "mask"?}.
    loss_chunk > 0 runs the head and the loss chunk by chunk: no (B, T, V) logits."""
    validate_batch(batch, config)
    check_precision(params, config)
    if config.loss_chunk:
        x = features(params, batch["inputs"], config, layers)  # (B, T, D)
        return layers.chunked_head_loss(params["head"], x, batch["targets"], batch.get("mask"),
                                        config.loss_chunk, config.compute_dtype)
    logits = forward(params, batch["inputs"], config, layers)  # (B, T, V)
    return layers.cross_entropy(logits, batch["targets"], batch.get("mask"))
