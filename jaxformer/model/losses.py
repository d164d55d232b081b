"""The loss: mean next-token cross entropy over the positions the mask keeps."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.model.precision import upcast


def mask_weights(mask, dtype):
    """(...) each position's share of the mean: mask / sum(mask), the true sum (a
    fractional mask is not rounded up to 1). A mask that sums to 0 (no position
    counts) gives weights of exactly 0: the sum is divided by 1 instead, so the loss
    is 0 and its gradient is 0, never a NaN, in eager calls and under jit alike. For a
    0/1 mask this is sum(nll over masked positions) / max(count, 1).
    """
    mask = mask.astype(dtype)
    total = jnp.sum(mask)
    return mask / jnp.where(total > 0, total, 1)


def cross_entropy(logits, targets, mask=None):
    """Mean of -log softmax(logits)[target] over the positions, weighted by ``mask``.

    logits (..., V), targets int (...), mask (...) or None. The weights are
    mask / sum(mask) (``mask_weights``); a mask that sums to 0 gives a loss of 0 and a
    gradient of 0 (for a 0/1 mask: the masked sum over max(count, 1)), eagerly and
    under jit. Runs in float32 or wider (``upcast``).
    """
    return weighted_mean(nll_and_logz(logits, targets)[0], mask)


def nll_and_logz(logits, targets):
    """(nll, logz), each (...) in float32 or wider: -log softmax(logits)[target] and the row's
    log-sum-exp, which the manual backward's softmax exp(logits - logz) reuses (one pass over
    the (..., V) logits for it, not a softmax of its own)."""
    logits = upcast(logits)
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return logz - target_logit, logz


def weighted_mean(nll, mask=None):
    """The mean of nll (...) over the positions, weighted by ``mask`` (``mask_weights``)."""
    if mask is None:
        return jnp.mean(nll)
    return jnp.sum(nll * mask_weights(mask, nll.dtype))
