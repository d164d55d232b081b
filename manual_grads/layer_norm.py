"""Layer norm over the last axis: y = (x - mean) * rstd * scale + bias."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.layer_norm import layer_norm_stats
from jaxformer.model.precision import upcast


def column_sums(*xs):
    """Each x (..., D) summed over every leading dim, (D,) each, in float32 or wider (as
    ``jnp.sum`` sums a 16-bit x): one reduction over all of them (a variadic reduce: on a GPU
    one kernel, where separate sums are a kernel, or two, apiece)."""
    D = xs[0].shape[-1]
    flat = [upcast(x).reshape(-1, D) for x in xs]
    zeros = [jnp.zeros((), x.dtype) for x in flat]
    return jax.lax.reduce(flat, zeros, lambda a, b: [u + v for u, v in zip(a, b)], (0,))


class LayerNormRes(NamedTuple):
    xhat: jax.Array  # (..., D) the normalized input (x - mean) * rstd, float32 or wider
    rstd: jax.Array  # (..., 1) 1 / sqrt(var + eps), float32 or wider
    scale: jax.Array  # (D,)
    has_bias: jax.Array | None = None  # (0,) empty when p has a bias (ModelConfig.bias), else None
    kernels: object | None = None  # static: norms.py's KERNELS where the forward ran the GPU kernels


def layer_norm_res(p, xhat, rstd) -> LayerNormRes:
    """What the backward keeps of a layer norm with params p, given its statistics."""
    if "bias" not in p:
        return LayerNormRes(xhat, rstd, p["scale"])
    return LayerNormRes(xhat, rstd, p["scale"], jnp.zeros((0,), p["bias"].dtype))


def layer_norm_fwd(p, x, eps):
    """p = {"scale": (D,), "bias": (D,) (optional)}; x (..., D) -> y (..., D)."""
    xhat, rstd = layer_norm_stats(x, eps)  # (..., D), (..., 1): kept for the backward
    y = xhat * p["scale"]
    return (y if "bias" not in p else y + p["bias"]), layer_norm_res(p, xhat, rstd)


def layer_norm_bwd(res: LayerNormRes, dy):
    """dy (..., D) -> ({"scale": (D,), "bias": (D,) if p has one}, dx (..., D)).

    Undoes ``y = xhat * scale + bias`` then ``xhat = (x - mean) * rstd``; the
    gradient reaches x directly and through the mean and the variance:
    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)).
    """
    xhat, rstd, scale, has_bias = res.xhat, res.rstd, res.scale, res.has_bias
    dy = upcast(dy)  # a 16-bit dy (a product's input cotangent) multiplies in float32
    # dscale = sum(dy * xhat), dbias = sum(dy), over every leading dim: (D,) each, in one reduction
    dscale, dbias = column_sums(dy * xhat, dy)
    dxhat = dy * scale  # (..., D)
    dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                 - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    if has_bias is None:
        return {"scale": dscale.astype(scale.dtype)}, dx
    return {"scale": dscale.astype(scale.dtype), "bias": dbias.astype(scale.dtype)}, dx
