"""The whole model: features, forward(params, inputs, config) -> logits, and loss_fn."""

from __future__ import annotations

import jax

from jaxformer.model.block import block
from jaxformer.model.chunked_loss import chunked_head_loss
from jaxformer.model.config import ModelConfig
from jaxformer.model.embedding import embed
from jaxformer.model.layer_norm import layer_norm
from jaxformer.model.linear import linear
from jaxformer.model.losses import cross_entropy
from jaxformer.model.params import validate_params
from jaxformer.model.precision import upcast
from jaxformer.model.validate import check_precision, validate_batch, validate_tokens

def features(params, inputs, config: ModelConfig):
    """inputs int (B, T) -> the head's input (B, T, D): embeddings, blocks, final norm.
    With remat "block" each scanned block is a jax.checkpoint: JAX's grad keeps only
    its input and recomputes the rest."""
    validate_tokens("inputs", inputs, config)
    validate_params(params, config)
    x = upcast(embed(params, inputs, config))  # (B, T, D), float32 or wider: the residual stream

    def layer(x, p):
        return block(p, x, config), None

    if config.remat == "block":
        layer = jax.checkpoint(layer)
    x, _ = jax.lax.scan(layer, x, params["blocks"])
    if config.norm == "pre":
        x = layer_norm(params["ln_f"], x, config.ln_eps)
    return x


def forward(params, inputs, config: ModelConfig):
    """inputs int (B, T) -> logits (B, T, V), in the dtype of the params (float32 when
    config.compute_dtype puts the matmuls of float32 params in bfloat16)."""
    x = features(params, inputs, config)  # (B, T, D)
    return linear(x, params["head"]["w"], params["head"]["b"], config.compute_dtype)  # (B, T, V)


def loss_fn(params, batch, config: ModelConfig):
    """Mean next-token cross entropy of ``batch`` = {"inputs", "targets", "mask"?}."""
    validate_batch(batch, config)
    check_precision(params, config)
    if config.loss_chunk:
        x = features(params, batch["inputs"], config)  # (B, T, D); no (B, T, V) logits
        return chunked_head_loss(params["head"], x, batch["targets"], batch.get("mask"),
                                 config.loss_chunk, config.compute_dtype)
    logits = forward(params, batch["inputs"], config)
    return cross_entropy(logits, batch["targets"], batch.get("mask"))
