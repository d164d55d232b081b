"""Elementwise activations: gelu (exact, erf), gelu_tanh, relu, tanh, silu, relu2.

Each residual type names its activation, so ``activation_bwd(res, dy)`` needs
no name: the backward of a residual is ``ACTIVATION_BWD[type(res)]``.
Activations have no parameters: a backward returns dx alone.

Under a 16-bit compute dtype (bfloat16) the forward keeps its residual in that dtype
(``precision.kept``: the largest residual of a block, (B, T, d_ff), in half the bytes);
the backward computes the derivative in the cotangent's dtype (float32) from it. float32
and float64 runs keep it as computed.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.activations import ACTIVATION_FNS, GELU_TANH_A, GELU_TANH_C
from jaxformer.model.precision import kept, upcast


class GeluRes(NamedTuple):
    x: jax.Array  # (...) the input


class GeluTanhRes(NamedTuple):
    x: jax.Array  # (...) the input


class ReluRes(NamedTuple):
    x: jax.Array  # (...) the input


class TanhRes(NamedTuple):
    y: jax.Array  # (...) the output tanh(x)


class SiluRes(NamedTuple):
    x: jax.Array  # (...) the input


class Relu2Res(NamedTuple):
    x: jax.Array  # (...) the input


def gelu_fwd(x):
    return ACTIVATION_FNS["gelu"](x), GeluRes(x)


def gelu_bwd(res: GeluRes, dy):
    """Undoes ``y = 0.5 * x * (1 + erf(x / sqrt(2)))``:
    dy/dx = Phi(x) + x * phi(x), with phi the standard normal density."""
    x = res.x
    cdf = 0.5 * (1.0 + jax.lax.erf(x / math.sqrt(2.0)))
    pdf = jnp.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return dy * (cdf + x * pdf)


def gelu_tanh_fwd(x):
    return ACTIVATION_FNS["gelu_tanh"](x), GeluTanhRes(x)


def gelu_tanh_bwd(res: GeluTanhRes, dy):
    """Undoes ``y = 0.5 * x * (1 + tanh(u))``, u = c * (x + a x^3):
    dy/dx = 0.5 * (1 + tanh(u)) + 0.5 * x * (1 - tanh(u)^2) * c * (1 + 3 a x^2)."""
    x = res.x
    th = jnp.tanh(GELU_TANH_C * (x + GELU_TANH_A * x**3))
    du_dx = GELU_TANH_C * (1.0 + 3.0 * GELU_TANH_A * x * x)
    return dy * (0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * du_dx)


def relu_fwd(x):
    return ACTIVATION_FNS["relu"](x), ReluRes(x)


def relu_bwd(res: ReluRes, dy):
    """Undoes ``y = max(x, 0)``: dy/dx = 1 where x > 0, 0 where x < 0, and 1/2
    at x == 0 (the subgradient JAX's grad of jnp.maximum picks at a tie)."""
    x = res.x
    slope = jnp.where(x > 0, 1.0, jnp.where(x == 0, 0.5, 0.0)).astype(dy.dtype)
    return dy * slope


def tanh_fwd(x):
    y = ACTIVATION_FNS["tanh"](x)
    return y, TanhRes(y)


def tanh_bwd(res: TanhRes, dy):
    """Undoes ``y = tanh(x)``: dy/dx = 1 - y^2."""
    return dy * (1.0 - res.y * res.y)


def silu_fwd(x):
    return ACTIVATION_FNS["silu"](x), SiluRes(x)


def silu_bwd(res: SiluRes, dy):
    """Undoes ``y = x * sigmoid(x)``: with s = sigmoid(x), s' = s (1 - s), so
    dy/dx = s + x s (1 - s) = s (1 + x (1 - s))."""
    x = res.x
    s = jax.nn.sigmoid(x)
    return dy * (s * (1.0 + x * (1.0 - s)))


def relu2_fwd(x):
    return ACTIVATION_FNS["relu2"](x), Relu2Res(x)


def relu2_bwd(res: Relu2Res, dy):
    """Undoes ``y = max(x, 0)^2``: dy/dx = 2 max(x, 0), 0 at x == 0 (no tie to break:
    relu's 1/2 there is multiplied by max(0, 0) = 0)."""
    return dy * (2.0 * jnp.maximum(res.x, 0))


ACTIVATION_FWD = {"gelu": gelu_fwd, "gelu_tanh": gelu_tanh_fwd, "relu": relu_fwd, "tanh": tanh_fwd,
                  "silu": silu_fwd, "relu2": relu2_fwd}
ACTIVATION_BWD = {GeluRes: gelu_bwd, GeluTanhRes: gelu_tanh_bwd, ReluRes: relu_bwd, TanhRes: tanh_bwd,
                  SiluRes: silu_bwd, Relu2Res: relu2_bwd}


def activation_fwd(name: str, x, compute_dtype=None):
    """The activation called ``name`` (a ModelConfig.activation) of x (...); its residual
    kept as ``precision.kept`` says for ``compute_dtype``."""
    y, res = ACTIVATION_FWD[name](x)
    return y, type(res)(*(kept(v, compute_dtype) for v in res))


def activation_bwd(res, dy):
    """dy (...) -> dx (...), for the activation whose residual is ``res``: the derivative in
    float32 or wider (a bfloat16 dy, a product's cotangent, and a bfloat16 residual upcast)."""
    dy = upcast(dy)
    res = type(res)(*(v.astype(jnp.promote_types(v.dtype, dy.dtype)) for v in res))
    return ACTIVATION_BWD[type(res)](res, dy)
