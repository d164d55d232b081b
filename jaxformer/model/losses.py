"""The loss: mean next-token cross entropy over the positions the mask keeps."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.model.precision import upcast

class EmptyMaskError(ValueError):
    """The loss mask's weights sum to 0: no position counts."""


def mask_weights(mask, dtype):
    """(...) each position's share of the mean: mask / sum(mask), the true sum (a
    fractional mask is not rounded up to 1).

    Eager calls refuse a mask that sums to 0 (EmptyMaskError). Under jit the sum is
    not known while tracing: an all-zero mask then gives weights, and a loss, of
    exactly 0 (an explicit ``where``), never a NaN.
    """
    mask = mask.astype(dtype)
    total = jnp.sum(mask)
    if not isinstance(total, jax.core.Tracer) and float(total) == 0:
        raise EmptyMaskError(f"the loss mask of shape {tuple(mask.shape)} sums to 0: no position counts")
    nonzero = total != 0
    return jnp.where(nonzero, mask / jnp.where(nonzero, total, 1), 0)


def cross_entropy(logits, targets, mask=None):
    """Mean of -log softmax(logits)[target] over the positions, weighted by ``mask``.

    logits (..., V), targets int (...), mask (...) or None. The weights are
    mask / sum(mask) (``mask_weights``: a zero sum is refused in eager calls and
    gives a loss of 0 under jit). Runs in float32 or wider (``upcast``).
    """
    logits = upcast(logits)
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = logz - target_logit
    if mask is None:
        return jnp.mean(nll)
    return jnp.sum(nll * mask_weights(mask, nll.dtype))
