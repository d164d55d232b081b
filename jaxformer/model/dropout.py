"""Dropout, and the keys it draws its masks from.

    y = x * keep / (1 - rate),   keep = uniform(key, x.shape) >= rate     (float32 uniforms)

A mask is a function of (key, rate, shape) alone, so the hand-derived backward
regenerates it from the key instead of keeping it. The keys of one step's forward:

    embedding output        fold_in(key, n_layers)
    block l                 k_l = fold_in(key, l)
      attention probs       fold_in(k_l, 0)   (blockwise: then fold_in(., i), fold_in(., j)
                                               for query block i, key block j)
      attention branch      fold_in(k_l, 1)
      feed-forward branch   fold_in(k_l, 2)

key None (or rate 0) is no dropout: evaluation, generation and compare-grads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ATTN_PROBS, ATTN_OUT, FFN_OUT = 0, 1, 2


def keep_mask(key, rate, shape):
    """bool (shape): True where the value is kept, each with probability 1 - rate."""
    return jax.random.uniform(key, shape, jnp.float32) >= jnp.asarray(rate, jnp.float32)


def active(rate, key) -> bool:
    """Whether dropout at ``rate`` with ``key`` drops anything: a key, and a rate other than
    0 (a traced rate counts as on). The one rule every dropout site asks."""
    return key is not None and not (isinstance(rate, (int, float)) and not rate)


def dropout(x, rate, key):
    """x * keep / (1 - rate); x itself when not ``active(rate, key)`` (rate may be a traced
    array: the hand-derived backward keeps it in its residuals)."""
    if not active(rate, key):
        return x
    keep = keep_mask(key, rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype)).astype(x.dtype)


def layer_key(key, l):
    """Block l's key (l may be traced: the scan's layer index)."""
    return jax.random.fold_in(key, l)


def embed_key(key, n_layers: int):
    """The embedding output's key."""
    return jax.random.fold_in(key, n_layers)


def sub_key(key, which: int):
    """One of a block's three dropout keys: ATTN_PROBS, ATTN_OUT or FFN_OUT."""
    return None if key is None else jax.random.fold_in(key, which)


def block_pair_key(key, i, j):
    """The key of the attention-probabilities mask of query block i, key block j."""
    return jax.random.fold_in(jax.random.fold_in(key, i), j)
