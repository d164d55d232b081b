"""The linear layer: x @ w + b, the product under the precision policy; a frozen w may be
held quantized (quantized.py), dequantized here inside the product."""

from __future__ import annotations

from jaxformer.model.precision import matmul
from jaxformer.model.quantized import dense


def linear(x, w, b=None, compute_dtype=None):
    """x @ w + b over any leading dims: x (..., I), w (I, O), b (O,) or None -> (..., O).
    The product runs in ``compute_dtype`` (see ``matmul``); the bias adds in float32."""
    y = matmul(x, dense(w), compute_dtype)  # dense: w itself, or its Quantized codes dequantized
    return y if b is None else y + b
