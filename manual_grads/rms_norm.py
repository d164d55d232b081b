"""RMS norm over the last axis: y = x * rstd * scale, rstd = 1 / sqrt(mean(x^2) + eps);
with an offset (ModelConfig.norm_offset; Gemma's 1) y = x * rstd * (offset + scale).

The same pair serves the residual stream (..., D), scale (D,), and each head's q and k
(B, H, T, Dh), scale (Dh,) (ModelConfig.qk_norm): it works over any leading shape.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.precision import upcast
from jaxformer.model.rms_norm import rms_norm_stats


class RMSNormRes(NamedTuple):
    xhat: jax.Array  # (..., D) the normalized input x * rstd, float32 or wider
    rstd: jax.Array  # (..., 1) 1 / sqrt(mean(x^2) + eps), float32 or wider
    scale: jax.Array | None  # (D,), or None when p has no scale (ModelConfig.norm_scale False)
    offset: jax.Array | None = None  # () the offset, in xhat's dtype; None: the scale applied as it is


def rms_norm_fwd(p, x, eps, offset=0.0):
    """p = {"scale": (D,)} or {}; x (..., D) -> y (..., D); the scale applied as (offset + scale)
    where ``offset`` is not 0."""
    xhat, rstd = rms_norm_stats(x, eps)  # (..., D), (..., 1): kept for the backward
    if "scale" not in p:
        return xhat, RMSNormRes(xhat, rstd, None)
    if not offset:
        return xhat * p["scale"], RMSNormRes(xhat, rstd, p["scale"])
    kept = jnp.asarray(offset, xhat.dtype)
    return xhat * (kept + upcast(p["scale"])), RMSNormRes(xhat, rstd, p["scale"], kept)


def rms_norm_bwd(res: RMSNormRes, dy):
    """dy (..., D) -> ({"scale": (D,)} or {}, dx (..., D)).

    Undoes ``y = xhat * scale`` (or ``xhat * (offset + scale)``, whose dscale is the same) then
    ``xhat = x * rstd``, rstd = (mean(x^2) + eps)^(-1/2).
    x reaches xhat directly and through rstd: d rstd / dx_j = -rstd^3 x_j / D, so
    dx = rstd * (dxhat - xhat * mean(dxhat * xhat)). No mean is subtracted in the
    forward, so no mean(dxhat) term either (layer norm's backward has one).
    """
    xhat, rstd, scale, offset = res
    D = xhat.shape[-1]
    if scale is None:
        dxhat = dy  # y = xhat
    elif offset is None:
        dxhat = dy * scale  # y = xhat * scale
    else:
        dxhat = dy * (offset + upcast(scale))  # y = xhat * (offset + upcast(p["scale"]))
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))  # (..., D)
    if scale is None:
        return {}, dx
    dscale = (dy * xhat).reshape(-1, D).sum(axis=0)  # (D,): summed over every leading axis
    return {"scale": dscale.astype(scale.dtype)}, dx
