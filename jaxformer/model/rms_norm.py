"""RMS norm over the last axis (Llama's RMSNorm), with statistics in float32 or wider:

    y = x * rsqrt(mean(x^2) + eps) * scale        (no mean subtracted, no bias)
    y = x * rsqrt(mean(x^2) + eps) * (offset + scale)     with an ``offset`` (ModelConfig.norm_offset)

Gemma's norms are the second with offset 1: the stored weight w is applied as (1 + w), added
in float32 or wider (``upcast``), as Gemma adds 1 to ``weight.float()``.
``p = {"scale": (D,)}``, or ``{}`` for an RMS norm with no learnable scale
(ModelConfig.norm_scale False). The same layer normalizes the residual stream
(norm_type "rms") and each head's q and k (qk_norm), over the last axis of any shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.model.layer_norm import row_scale
from jaxformer.model.precision import upcast


def rms_norm_stats(x, eps, axis_name: str | None = None):
    """x (..., D) -> xhat = x * rstd (..., D) and rstd = 1 / sqrt(mean(x^2) + eps) (..., 1),
    in float32 or wider. As layer_norm_stats, computed on xs = x * s (s = row_scale(x), an
    exact power of two): mean(x^2) + eps = (mean(xs^2) + eps s^2) / s^2.
    ``axis_name``: x is this device's D of a row's t D features, split over that mesh axis
    (inside shard_map; tensor parallelism's QK-norm over every head): the mean is over all of
    them, psum(sum(xs^2)) / (t D), one (..., 1) all-reduce."""
    x = upcast(x)
    s = row_scale(x, axis_name)  # (..., 1)
    xs = x * s
    if axis_name is None:
        ms = jnp.mean(xs * xs, axis=-1, keepdims=True)
    else:
        ms = jax.lax.psum(jnp.sum(xs * xs, axis=-1, keepdims=True), axis_name) / (
            x.shape[-1] * jax.lax.axis_size(axis_name))
    r = jax.lax.rsqrt(ms + eps * s * s)  # (..., 1)
    return xs * r, s * r


def rms_norm(p, x, eps, offset=0.0, axis_name: str | None = None):
    """p = {"scale": (D,)} or {} (no scale); x (..., D) -> (..., D), float32 or wider; the scale
    applied as (offset + scale) where ``offset`` is not 0. ``axis_name``: x's features (and the
    scale's) are this device's part of a row split over that mesh axis (rms_norm_stats)."""
    xhat, _ = rms_norm_stats(x, eps, axis_name)
    if "scale" not in p:
        return xhat
    return xhat * (offset + upcast(p["scale"])) if offset else xhat * p["scale"]
