"""RMS norm over the last axis: y = x * rstd * scale, rstd = 1 / sqrt(mean(x^2) + eps);
with an offset (ModelConfig.norm_offset; Gemma's 1) y = x * rstd * (offset + scale).

The same pair serves the residual stream (..., D), scale (D,), and each head's q and k
(B, H, T, Dh), scale (Dh,) (ModelConfig.qk_norm): it works over any leading shape.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.precision import upcast
from jaxformer.model.rms_norm import rms_norm_stats


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class SplitAxis:
    """The mesh axis a norm's features split over (tensor parallelism's QK-norm over every
    head), carried by a residual as a static node."""
    name: str


class RMSNormRes(NamedTuple):
    xhat: jax.Array  # (..., D) the normalized input x * rstd, float32 or wider
    rstd: jax.Array  # (..., 1) 1 / sqrt(mean(x^2) + eps), float32 or wider
    scale: jax.Array | None  # (D,), or None when p has no scale (ModelConfig.norm_scale False)
    offset: jax.Array | None = None  # () the offset, in xhat's dtype; None: the scale applied as it is
    split: SplitAxis | None = None  # static: x is this device's part of each row's features
    kernels: object | None = None  # static: norms.py's KERNELS where the forward ran the GPU kernels


def rms_norm_fwd(p, x, eps, offset=0.0, axis_name: str | None = None):
    """p = {"scale": (D,)} or {}; x (..., D) -> y (..., D); the scale applied as (offset + scale)
    where ``offset`` is not 0. ``axis_name``: x (and the scale) are this device's part of each
    row's features, split over that mesh axis (the model's rms_norm_stats)."""
    xhat, rstd = rms_norm_stats(x, eps, axis_name)  # (..., D), (..., 1): kept for the backward
    res = rms_norm_res(p, xhat, rstd, offset, axis_name)
    if "scale" not in p:
        return xhat, res
    if not offset:
        return xhat * p["scale"], res
    return xhat * (res.offset + upcast(p["scale"])), res


def rms_norm_res(p, xhat, rstd, offset=0.0, axis_name: str | None = None) -> RMSNormRes:
    """What the backward keeps of an RMS norm with params p, given its statistics (the
    offset in rstd's dtype, the statistics')."""
    split = None if axis_name is None else SplitAxis(axis_name)
    if "scale" not in p:
        return RMSNormRes(xhat, rstd, None, split=split)
    if not offset:
        return RMSNormRes(xhat, rstd, p["scale"], split=split)
    return RMSNormRes(xhat, rstd, p["scale"], jnp.asarray(offset, rstd.dtype), split)


def rms_norm_bwd(res: RMSNormRes, dy):
    """dy (..., D) -> ({"scale": (D,)} or {}, dx (..., D)).

    Undoes ``y = xhat * scale`` (or ``xhat * (offset + scale)``, whose dscale is the same) then
    ``xhat = x * rstd``, rstd = (mean(x^2) + eps)^(-1/2).
    x reaches xhat directly and through rstd: d rstd / dx_j = -rstd^3 x_j / D, so
    dx = rstd * (dxhat - xhat * mean(dxhat * xhat)). No mean is subtracted in the
    forward, so no mean(dxhat) term either (layer norm's backward has one).
    With ``res.split`` the mean in rstd was over every device's features, and so is the mean
    of dxhat * xhat: psum(sum(dxhat * xhat)) / (t D), the same all-reduce as the forward's.
    """
    xhat, rstd, scale, offset, split = res.xhat, res.rstd, res.scale, res.offset, res.split
    D = xhat.shape[-1]
    dy = upcast(dy)  # a 16-bit dy (a product's input cotangent) multiplies in float32
    if scale is None:
        dxhat = dy  # y = xhat
    elif offset is None:
        dxhat = dy * scale  # y = xhat * scale
    else:
        dxhat = dy * (offset + upcast(scale))  # y = xhat * (offset + upcast(p["scale"]))
    if split is None:
        m = (dxhat * xhat).mean(axis=-1, keepdims=True)  # (..., 1)
    else:  # mean(x^2) = psum(sum(x^2)) / (t D)
        m = jax.lax.psum((dxhat * xhat).sum(axis=-1, keepdims=True), split.name) / (
            D * jax.lax.axis_size(split.name))
    dx = rstd * (dxhat - xhat * m)  # (..., D)
    if scale is None:
        return {}, dx
    dscale = (dy * xhat).reshape(-1, D).sum(axis=0)  # (D,): summed over every leading axis
    return {"scale": dscale.astype(scale.dtype)}, dx
