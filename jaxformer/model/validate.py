"""Checks of the model's inputs: token ids, batches, masks, params dtype; each names what is wrong."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.model.checks import check_int
from jaxformer.model.config import ModelConfig
from jaxformer.model.quantized import is_quantized


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
    leaves = jax.tree_util.tree_leaves(params, is_leaf=is_quantized)  # a Quantized: the dtype it dequantizes to
    dtypes = sorted({jnp.dtype(x.dtype).name for x in leaves})
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


def as_id_array(ids, name: str) -> np.ndarray:
    """ids as a numpy integer array (any shape); ValueError unless integer-valued."""
    arr = np.asarray(ids)
    if arr.size == 0 and arr.dtype.kind not in "iu":
        arr = arr.astype(np.int64)  # an empty list comes in as float64
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr


def validate_ids(ids, vocab_size: int, name: str = "ids") -> None:
    """Raise ValueError naming the first id outside [0, vocab_size) and its position.

    ``ids`` is any integer array-like (numpy, jax, list). The position is an int for
    a 1-D array and an index tuple otherwise, in C order.
    """
    vocab_size = check_int("vocab_size", vocab_size)
    arr = as_id_array(ids, name)
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        where = np.argwhere(bad)[0]
        pos = int(where[0]) if arr.ndim == 1 else tuple(int(i) for i in where)
        raise ValueError(
            f"{name} holds token id {int(arr[tuple(where)])} at position {pos}, outside "
            f"[0, vocab_size={vocab_size})"
        )
