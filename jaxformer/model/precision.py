"""The precision policy (``ModelConfig.compute_dtype``), in one place: matmul inputs
in the compute dtype with float32 (or wider) accumulation, statistics in float32 or
wider. ``jaxformer.layers`` and ``jaxformer.blockwise`` both use it; docs/design.md,
"Mixed precision", has the table."""

from __future__ import annotations

import jax.numpy as jnp


def stats_dtype(dtype):
    """The dtype of statistics (layer norm, softmax, log-sum-exp, cross entropy) and of
    matmul accumulation: float32, or the input's dtype when wider (float64 stays float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def upcast(x):
    """x in stats_dtype(x.dtype): a no-op for float32 and float64."""
    return x.astype(stats_dtype(x.dtype))


def cast(x, compute_dtype):
    """x in the compute dtype (a ModelConfig.compute_dtype); None leaves x as it is."""
    return x if compute_dtype is None else x.astype(compute_dtype)


def kept(x, compute_dtype):
    """x in the compute dtype where that is a 16-bit float (bfloat16: half the bytes to write
    and read back), else as computed, so float32 and float64 runs keep full precision. Two uses:
    a residual that a backward reads and no product does (a norm's normalized input, an
    activation's input), as the manual forward keeps it; and the output of a product that only
    elementwise work and other products read (the q/k/v and feed-forward input projections,
    rounded after their bias as autocast returns them; docs/design.md, "Mixed precision")."""
    return x.astype(kept_dtype(x.dtype, compute_dtype))


def kept_dtype(dtype, compute_dtype):
    """The dtype ``kept`` gives an x of ``dtype``: the compute dtype where that is a 16-bit
    float, else ``dtype``."""
    if compute_dtype is None or jnp.dtype(compute_dtype).itemsize >= 4:
        return jnp.dtype(dtype)
    return jnp.dtype(compute_dtype)


def matmul(a, b, compute_dtype=None):
    """a @ b with both inputs cast to ``compute_dtype`` and the product accumulated and
    returned in stats_dtype of the inputs' own dtype (float32 for float32 or bfloat16
    inputs). None, or a float32 or wider compute dtype equal to the inputs', is plain ``a @ b``."""
    out = jnp.result_type(a, b)
    if compute_dtype is None or (jnp.dtype(compute_dtype) == out == a.dtype == b.dtype
                                 and jnp.dtype(compute_dtype).itemsize >= 4):
        return a @ b
    return jnp.matmul(a.astype(compute_dtype), b.astype(compute_dtype),
                      preferred_element_type=stats_dtype(out))
