"""Softmax cross entropy, fused with its backward.

    loss = sum_i w_i * (logsumexp(logits_i) - logits_i[target_i])
    w_i  = mask_i / sum(mask)             (1 / N without a mask; 0 for a mask that sums to 0)
    dlogits_i = dloss * w_i * (softmax(logits_i) - onehot(target_i))

The softmax subtracts the row max, so logits of magnitude 1e4 are fine. The
mask is treated as a constant: its cotangent, like the integer targets', is None.
Everything here runs in float32 or wider (``upcast``), whatever the logits' dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.chunked_loss import position_weights
from jaxformer.model.precision import upcast
from jaxformer.model.losses import nll_and_logz, weighted_mean


class CrossEntropyRes(NamedTuple):
    probs: jax.Array  # (..., V) softmax(logits)
    targets: jax.Array  # (...) int
    weights: jax.Array  # (...) each position's share of the mean: mask / sum(mask) (0s: all-zero mask)


def cross_entropy_fwd(logits, targets, mask=None):
    """logits (..., V), targets int (...), mask (...) or None -> scalar loss."""
    nll, logz = nll_and_logz(logits, targets)  # the model's cross_entropy: the weighted mean of nll
    loss = weighted_mean(nll, mask)
    probs = jnp.exp(upcast(logits) - logz[..., None])  # (..., V) softmax(logits), from the forward's logz
    return loss, CrossEntropyRes(probs, targets, position_weights(targets, mask, probs.dtype))


def cross_entropy_bwd(res: CrossEntropyRes, dloss):
    """dloss () -> (dlogits (..., V), None, None); dlogits in float32 or wider.

    Undoes ``nll = logsumexp(logits) - logits[target]`` and the weighted mean:
    dlogits = dloss * w * (softmax(logits) - onehot(target)); exactly 0 where w is 0
    (every position of a mask that sums to 0).
    """
    probs, targets, weights = res
    onehot = jax.nn.one_hot(targets, probs.shape[-1], dtype=probs.dtype)  # (..., V)
    dlogits = (dloss * weights)[..., None] * (probs - onehot)  # (..., V)
    return dlogits, None, None
