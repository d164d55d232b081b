"""Dropout, by hand: y = x * keep / (1 - rate), keep = keep_mask(key, rate, x.shape).

The residual is the key and the rate, never the mask: the backward draws the same
mask again from the key (jaxformer/model/dropout.py) and undoes
    dx = dy * keep / (1 - rate).
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from jaxformer.model.dropout import active, dropout


class DropoutRes(NamedTuple):
    key: jax.Array  # the PRNG key the mask was drawn from
    rate: jax.Array  # () the drop probability


def dropout_fwd(x, rate, key):
    """x (...) -> (y (...), DropoutRes or None when dropout is off: ``active(rate, key)``)."""
    if not active(rate, key):
        return x, None
    return dropout(x, rate, key), DropoutRes(key, rate)


def dropout_bwd(res: DropoutRes | None, dy):
    """dy (...) -> dx (...): undoes ``y = where(keep, x / (1 - rate), 0)`` with the mask redrawn."""
    if res is None:
        return dy
    return dropout(dy, res.rate, res.key)
