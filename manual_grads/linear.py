"""Linear layer: y = x @ w + b over any leading dims.

Shape letters: N stands for the flattened leading dims (B*T in the model),
I for the input width, O for the output width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from jaxformer.layers import linear


class LinearRes(NamedTuple):
    x: jax.Array  # (..., I) the input
    w: jax.Array  # (I, O)


def linear_fwd(p, x):
    """p = {"w": (I, O), "b": (O,)}; x (..., I) -> y (..., O)."""
    y = linear(x, p["w"], p["b"])  # (..., O)
    return y, LinearRes(x, p["w"])


def linear_bwd(res: LinearRes, dy):
    """dy (..., O) -> ({"w": (I, O), "b": (O,)}, dx (..., I)).

    Undoes ``y = x @ w + b``: dw = x^T dy and db = sum(dy), both summed over
    every leading dim; dx = dy @ w^T.
    """
    x, w = res
    I, O = w.shape
    x2, dy2 = x.reshape(-1, I), dy.reshape(-1, O)  # (N, I), (N, O)
    dw = x2.T @ dy2  # (I, O)
    db = dy2.sum(axis=0)  # (O,)
    dx = dy @ w.T  # (..., I)
    return {"w": dw, "b": db}, dx
