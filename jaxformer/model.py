"""The whole model: forward(params, inputs, config) -> logits, and the loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.chunked_loss import chunked_head_loss
from jaxformer.config import ModelConfig
from jaxformer.data import validate_ids
from jaxformer.layers import block, embed, layer_norm, linear, upcast
from jaxformer.params import validate_params


def _concrete(x) -> bool:
    """True when x holds values (an eager call), False under jit/grad tracing."""
    return not isinstance(x, jax.core.Tracer)


def validate_tokens(name: str, ids, config: ModelConfig) -> None:
    """Raise ValueError unless ids is an integer (B, T) array with T <= max_seq_len and
    every id in [0, vocab_size). Shapes and dtypes are checked under jit too; values
    only in eager calls (a traced value cannot be inspected)."""
    if not hasattr(ids, "shape") or not hasattr(ids, "dtype"):
        raise ValueError(f"{name} must be an integer array of shape (B, T), got {type(ids).__name__}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"{name} must have an integer dtype, got {ids.dtype}")
    if ids.ndim != 2:
        raise ValueError(f"{name} must have shape (B, T), got shape {tuple(ids.shape)}")
    if ids.shape[1] > config.max_seq_len:
        raise ValueError(
            f"{name} has sequence length {ids.shape[1]}, longer than "
            f"max_seq_len={config.max_seq_len}"
        )
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"{name} is empty: shape {tuple(ids.shape)}")
    if _concrete(ids):
        validate_ids(ids, config.vocab_size, name)


def validate_batch(batch, config: ModelConfig) -> None:
    """Raise ValueError naming the key, shape or token id that makes ``batch`` unusable."""
    if not isinstance(batch, dict) or "inputs" not in batch or "targets" not in batch:
        raise ValueError("batch must be a dict with keys 'inputs' and 'targets' (and optionally 'mask')")
    validate_tokens("batch['inputs']", batch["inputs"], config)
    validate_tokens("batch['targets']", batch["targets"], config)
    shape = tuple(batch["inputs"].shape)
    for key in ("targets", "mask"):
        if batch.get(key) is not None and tuple(jnp.shape(batch[key])) != shape:
            raise ValueError(
                f"batch['{key}'] has shape {tuple(jnp.shape(batch[key]))}, "
                f"batch['inputs'] has {shape}"
            )
    validate_mask(batch.get("mask"))


def check_precision(params, config: ModelConfig) -> None:
    """Raise ValueError when the params' dtype or config.compute_dtype is float16, for
    which neither gradient source is offered: float16's narrow range (6e-8 .. 65504)
    lets backward cotangents underflow and large activations overflow into non-finite
    gradients without loss scaling. bfloat16 has float32's range."""
    if config.compute_dtype == "float16":
        raise ValueError(
            "ModelConfig.compute_dtype='float16' has no gradient: float16's range lets "
            "cotangents underflow and activations overflow; use compute_dtype='bfloat16'")
    dtypes = sorted({jnp.dtype(x.dtype).name for x in jax.tree_util.tree_leaves(params)})
    if "float16" in dtypes:
        raise ValueError(
            "params dtype float16 has no gradient (its range makes the gradients non-finite); "
            "keep float32 params and set ModelConfig.compute_dtype='bfloat16'")



def validate_mask(mask) -> None:
    """Raise ValueError when the loss mask holds a negative, NaN or infinite weight
    (eager calls only: a traced value cannot be inspected)."""
    if mask is None or not _concrete(mask):
        return
    m = np.asarray(mask)
    if m.dtype == bool or np.issubdtype(m.dtype, np.unsignedinteger):
        return
    if not np.all(np.isfinite(m)):
        raise ValueError("batch['mask'] holds NaN or infinite values; weights must be finite and >= 0")
    if np.any(m < 0):
        raise ValueError(f"batch['mask'] holds negative values (min {m.min()}); weights must be >= 0")


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


def cross_entropy(logits, targets, mask=None):
    """Mean of -log softmax(logits)[target] over positions where mask is 1.

    logits (..., V), targets int (...), mask (...) or None. With a mask of all
    zeros the loss is 0 (no position counts). Runs in float32 or wider (``upcast``).
    """
    logits = upcast(logits)
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = logz - target_logit
    if mask is None:
        return jnp.mean(nll)
    mask = mask.astype(nll.dtype)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1)


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
