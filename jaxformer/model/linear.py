"""The linear layer: x @ w + b, the product under the precision policy."""

from __future__ import annotations

from jaxformer.model.precision import matmul

def linear(x, w, b=None, compute_dtype=None):
    """x @ w + b over any leading dims: x (..., I), w (I, O), b (O,) or None -> (..., O).
    The product runs in ``compute_dtype`` (see ``matmul``); the bias adds in float32."""
    y = matmul(x, w, compute_dtype)
    return y if b is None else y + b
