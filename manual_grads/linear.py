"""Linear layer: y = x @ w + b over any leading dims.

Shape letters: N stands for the flattened leading dims (B*T in the model),
I for the input width, O for the output width.

Mixed precision (``compute_dtype``): the forward keeps x in the compute dtype, the
dtype its product read it in, and the backward runs its two products in the dtype of
that residual with float32 accumulation (``jaxformer.layers.matmul``); dw and db come
back in w's dtype.

A frozen w held quantized (jaxformer/model/quantized.py: a LoRA run's base) is dequantized
inside dx's product exactly as the forward's ``linear`` dequantizes it; its dw is a float (I, O)
that no gradient source returns, so under jit it is never computed.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.linear import linear
from jaxformer.model.precision import cast, kept, matmul, upcast
from jaxformer.model.quantized import dense


class Cotangent(NamedTuple):
    """A product's output cotangent as a norm's backward writes it for that product (the block's
    residual stream, manual_grads/norms.py): ``wide`` (..., O) as computed (float32 under a bfloat16
    policy); ``narrow``, its copy in the product's 16-bit compute dtype, which the products read
    (None: they read ``wide``); ``sums``, its column sums (O,), the bias gradient (None: the layer
    has no bias). Written in the norm's own pass, so no kernel of its own reads ``wide`` again."""
    wide: jax.Array
    narrow: jax.Array | None = None
    sums: jax.Array | None = None


def wide(dy):
    """dy as computed: a Cotangent's ``wide``, any other array itself."""
    return dy.wide if isinstance(dy, Cotangent) else dy


class LinearRes(NamedTuple):
    x: jax.Array  # (..., I) the input, in the compute dtype
    w: jax.Array  # (I, O), in the params' dtype
    b: jax.Array | None = None  # (O,) the bias, or None for a layer without one (no "b" gradient)


def linear_fwd(p, x, compute_dtype=None, narrow=False):
    """p = {"w": (I, O), "b": (O,) (optional)}; x (..., I) -> y (..., O). ``narrow``: the model's
    linear's (the product rounded to a 16-bit compute dtype before the bias; the backward is the
    same: its caller rounds the sum's cotangent as well)."""
    y = linear(x, p["w"], p.get("b"), compute_dtype, narrow)  # (..., O)
    return y, LinearRes(cast(x, compute_dtype), p["w"], p.get("b"))


def backward_dtype(x, w):
    """The compute dtype a backward's products run in: that of the residual x, the
    matmul input the forward kept (None, plain ``@``, when it is w's own dtype)."""
    return None if x.dtype == w.dtype else x.dtype


def linear_bwd(res: LinearRes, dy, round_dx=True):
    """dy (..., O) -> ({"w": (I, O), "b": (O,) if the layer has a bias}, dx (..., I)).

    Undoes ``y = x @ w + b``: dw = x^T dy and db = sum(dy), both summed over
    every leading dim; dx = dy @ w^T, rounded to a 16-bit compute dtype (the dtype x is kept in:
    ``precision.kept``) unless ``round_dx`` is False (the head's dx, the blocks' first cotangent).
    A Cotangent dy: the products read its narrow copy and db is its sums.
    """
    x, w, b = res
    cd = backward_dtype(x, w)
    I, O = w.shape
    cot, dy = (dy, dy.wide if dy.narrow is None else dy.narrow) if isinstance(dy, Cotangent) else (None, dy)
    x2, dy2 = x.reshape(-1, I), dy.reshape(-1, O)  # (N, I), (N, O)
    dw = matmul(x2.T, dy2, cd)  # (I, O)
    # y = matmul(x, dense(w)): dx through the same dequantized w (w itself when float)
    dx = matmul(dy2, dense(w).T, cd).reshape(dy.shape[:-1] + (I,))  # (..., I): from the (N, O) dy2 that
    # dw reads, so an elementwise producer of dy (the loss's dlogits, an activation's) runs once
    if round_dx:  # under a bfloat16 policy the cotangent of the product's bfloat16 input is bfloat16 (and
        dx = kept(dx, x.dtype)  # half the bytes to write and read back)
    if b is None:
        return {"w": dw.astype(w.dtype)}, dx
    if cot is not None and cot.sums is not None:  # summed in the norm's pass
        return {"w": dw.astype(w.dtype), "b": cot.sums.astype(w.dtype)}, dx
    dy2 = dy2 if cot is None else cot.wide.reshape(-1, O)  # the sum of dy as computed, not of its copy
    db = upcast(dy2).sum(axis=0)  # (O,), summed in float32 or wider (dy2 may be a bfloat16 cotangent)
    return {"w": dw.astype(w.dtype), "b": db.astype(w.dtype)}, dx


def widened(dx, dy):
    """A layer's input cotangent dx in the dtype of its output cotangent dy where linear_bwd
    rounded it narrower (float32 under a bfloat16 policy: the residual stream's dtype, the
    layer input's own); XLA fuses the cast into dx's consumer, so the product still writes
    bfloat16."""
    return dx.astype(jnp.promote_types(dx.dtype, wide(dy).dtype))
