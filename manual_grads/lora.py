"""LoRA's hand-derived backward: dA, dB and dx of the adapters' term (jaxformer/model/lora.py).

Forward, per adapted weight W of a projection y = x [W_1 | W_2 | ...] + b:
    xd = drop(x)                    (..., I)   only where the site has a dropout key
    u = xd @ A                      (..., r)
    delta = s u @ B                 (..., O)   s = alpha / r
    y = y + [delta_1 | delta_2 | ...]         zeros in the columns of a weight without adapter
Backward, bottom to top, from dy (..., sum of the O's):
    dy_n = dy's columns of W_n
    dB = u^T (s dy_n);  du = (s dy_n) @ B^T
    dA = xd^T du;       dxd = du @ A^T
    dx += drop'(dxd)                the same mask, redrawn from the key
The frozen W never gets a gradient here: the projection's own backward (linear.py) gives dx
through W, and a gradient source that returns only the adapters' gradients (``lora_value_and_grad``)
leaves W's dW unused, so XLA never computes it (docs/finetune.md measures it).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.lora import LORA, lora_down, lora_up, site_key
from jaxformer.model.precision import cast
from manual_grads.dropout import DropoutRes, dropout_bwd, dropout_fwd
from manual_grads.linear import LinearRes, linear_bwd


class AdapterRes(NamedTuple):
    down: LinearRes  # x = drop(x) (..., I) in the compute dtype, w = A (I, r)
    up: LinearRes  # x = u (..., r), w = B (r, O)
    scale: jax.Array  # () s = alpha / r
    drop: DropoutRes | None  # the input's dropout key and rate; None: no dropout


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Columns:
    """Static (no leaves): which weights a projection's columns belong to."""
    names: tuple  # the projection's weights, in column order
    widths: tuple  # their output widths O
    fixed: tuple  # the site's leaves that get no gradient (scale, and rate, key with dropout)


class AdaptedRes(NamedTuple):
    columns: Columns  # static: names, widths, the leaves without gradient
    adapters: dict  # name -> AdapterRes, for the adapted names only


def adapted_fwd(p, names, x, y, compute_dtype=None):
    """The model's ``adapted``: y (..., sum O) + each adapted name's s (drop(x) A) B in its
    columns -> (y, res); res None where p has no adapters for ``names``."""
    site = p.get(LORA)
    if site is None or not any(n in site for n in names):
        return y, None
    parts, kept = [], {}
    for n in names:
        if n not in site:
            parts.append(jnp.zeros(y.shape[:-1] + (p[n].shape[-1],), y.dtype))
            continue
        _, drop = dropout_fwd(x, site.get("rate", 0.0), site_key(site, n))  # the mask's key, kept
        xd, u = lora_down(site, n, x, compute_dtype)  # drop(x) (..., I), u (..., r)
        parts.append(lora_up(site, n, u, compute_dtype))  # s u @ B (..., O)
        kept[n] = AdapterRes(LinearRes(cast(xd, compute_dtype), site[n]["a"]),
                             LinearRes(cast(u, compute_dtype), site[n]["b"]), site["scale"], drop)
    delta = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    widths = tuple(p[n].shape[-1] for n in names)
    fixed = tuple(k for k in site if not isinstance(site[k], dict))
    return y + delta.astype(y.dtype), AdaptedRes(Columns(tuple(names), widths, fixed), kept)


def adapter_bwd(res: AdapterRes, dy):
    """dy (..., O) -> ({"a": (I, r), "b": (r, O)}, dx (..., I)) of delta = s (drop(x) A) B."""
    # delta = s * (u @ B)
    d_up, du = linear_bwd(res.up, res.scale * dy)  # dB (r, O), du (..., r)
    # u = xd @ A
    d_down, dxd = linear_bwd(res.down, du)  # dA (I, r), dxd (..., I)
    # xd = drop(x)
    return {"a": d_down["w"], "b": d_up["w"]}, dropout_bwd(res.drop, dxd)


def adapted_bwd(res: AdaptedRes | None, dy):
    """dy (..., sum O) -> ({"lora": {name: {"a", "b"}, scale: None, ...}} (or {} without
    adapters), dx (..., I) or None). The site's scale, rate and key get None (no cotangent)."""
    if res is None:
        return {}, None
    cols = res.columns
    cuts = list(itertools.accumulate(cols.widths))[:-1]
    dys = jnp.split(dy, cuts, axis=-1) if cuts else [dy]  # y = y + [delta_1 | delta_2 | ...]
    grads, dx = dict.fromkeys(cols.fixed), None
    for n, dy_n in zip(cols.names, dys):
        if n in res.adapters:
            grads[n], dx_n = adapter_bwd(res.adapters[n], dy_n)
            dx = dx_n if dx is None else dx + dx_n
    return {LORA: grads}, dx


def add_dx(dx, dx_lora):
    """The base projection's dx plus the adapters' (None: none)."""
    return dx if dx_lora is None else dx + dx_lora.astype(dx.dtype)
