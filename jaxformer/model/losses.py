"""The loss: mean next-token cross entropy over the positions the mask keeps."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.model.precision import upcast

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
