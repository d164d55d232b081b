"""Layer norm over the last axis, with statistics in float32 or wider."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.model.precision import upcast

def row_scale(x, axis_name: str | None = None):
    """(..., 1) power of two s with max|x * s| in [0.5, 1) for rows whose max |x| is at
    least 1, and s = 1 otherwise. Multiplying by a power of two is exact, and s carries
    no gradient: it only keeps the statistics below away from overflow and underflow.
    ``axis_name``: each row's features are split over that mesh axis (inside shard_map): the
    max over every device's, so that each device scales its part by the same s."""
    top = jax.lax.stop_gradient(jnp.max(jnp.abs(x), axis=-1, keepdims=True))
    finite = jnp.isfinite(x).all(axis=-1, keepdims=True)
    if axis_name is not None:  # a device's non-finite part makes the row's max inf on every device
        top = jax.lax.pmax(jnp.where(finite, top, jnp.inf), axis_name)
        finite = jnp.isfinite(top)
    _, exponent = jnp.frexp(top)
    exponent = jnp.where(finite, exponent, 0)
    return jax.lax.stop_gradient(jnp.ldexp(jnp.ones((), x.dtype), -jnp.maximum(exponent, 0)))


def layer_norm_stats(x, eps):
    """Normalize over the last axis: x (..., D) -> xhat (..., D), rstd (..., 1), both in
    float32 or wider (``upcast``).

    Computed on xs = x * s, s = row_scale(x): var(x) + eps = (var(xs) + eps s^2) / s^2,
    so xhat = (xs - mean(xs)) * rsqrt(var(xs) + eps s^2) and rstd = s * rsqrt(...). The
    statistics of xs are O(1), so neither the squares in the forward nor the
    (var + eps)^(-3/2) that JAX's grad forms in the backward leave the float range."""
    x = upcast(x)
    s = row_scale(x)  # (..., 1)
    xs = x * s
    xc = xs - jnp.mean(xs, axis=-1, keepdims=True)
    var = jnp.mean(xc * xc, axis=-1, keepdims=True)
    r = jax.lax.rsqrt(var + eps * s * s)  # (..., 1): 1 / sqrt(var(xs) + eps s^2)
    return xc * r, s * r


def layer_norm(p, x, eps):
    """p = {"scale": (D,), "bias": (D,) (absent with bias=False)}; x (..., D) -> (..., D)."""
    xhat, _ = layer_norm_stats(x, eps)
    y = xhat * p["scale"]
    return y + p["bias"] if "bias" in p else y
