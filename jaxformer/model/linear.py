"""The linear layer: x @ w + b, the product under the precision policy; a frozen w may be
held quantized (quantized.py), dequantized here inside the product."""

from __future__ import annotations

from jaxformer.model.precision import kept, matmul
from jaxformer.model.quantized import dense


def linear(x, w, b=None, compute_dtype=None, narrow=False):
    """x @ w + b over any leading dims: x (..., I), w (I, O), b (O,) or None -> (..., O).
    The product runs in ``compute_dtype`` (see ``matmul``); the bias adds in float32.
    ``narrow``: the product comes out rounded to a 16-bit compute dtype (``kept``), as a GPU's
    GEMM writes a bfloat16 output, before the bias: for a caller that rounds the sum too (the
    q/k/v and feed-forward input projections), so the product's float32 never reaches memory."""
    y = matmul(x, dense(w), compute_dtype)  # dense: w itself, or its Quantized codes dequantized
    if narrow:
        y = kept(y, compute_dtype)
    return y if b is None else y + b
