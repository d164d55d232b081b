"""The shared expert's hand-derived backward: the pair of jaxformer/model/shared_expert.py.

Forward (x (N, D), the MoE layer's flattened input):
    h = (act(x @ w_gate) * (x @ w_up)) @ w_down         (N, D)  the gated MLP (manual_grads/mlp.py)
    s = sigmoid(x @ shared_gate)                        (N, 1)  with shared_expert_gate
    y = s * h                                           (N, D)  (y = h without the gate)
Backward:
    dh = s dy;  ds = sum_d dy h;  dg = ds s (1 - s)     d sigmoid(g) / dg = s (1 - s)
    dshared_gate = x^T dg;  dx = dg shared_gate^T + the gated MLP's dx
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.precision import upcast
from manual_grads.linear import LinearRes, linear_bwd, linear_fwd
from manual_grads.mlp import GatedFeedForwardRes, gated_feed_forward_bwd, gated_feed_forward_fwd


class SharedExpertRes(NamedTuple):
    mlp: GatedFeedForwardRes  # the gated MLP's, of x
    h: jax.Array  # (N, D) the gated MLP's output
    gate: LinearRes | None  # x (N, D), shared_gate (D, 1); None without shared_expert_gate
    s: jax.Array | None  # (N, 1) sigmoid(x @ shared_gate), float32 or wider; None without the gate


def shared_expert_fwd(p, x, config):
    """x (N, D) -> (s * gated_mlp(x) (N, D), SharedExpertRes)."""
    h, mlp_res = gated_feed_forward_fwd(p["shared"], x, config.activation, config.compute_dtype)  # (N, D)
    if not config.shared_expert_gate:
        return h, SharedExpertRes(mlp_res, h, None, None)
    g, gate_res = linear_fwd({"w": p["shared_gate"]}, x, config.compute_dtype)  # (N, 1)
    s = jax.nn.sigmoid(upcast(g))  # s = sigmoid(upcast(linear(x, shared_gate)))
    return s * h, SharedExpertRes(mlp_res, h, gate_res, s)


def shared_expert_bwd(res: SharedExpertRes, dy):
    """dy (N, D) -> ({"shared": {w_gate, w_up, w_down}, "shared_gate"?}, dx (N, D))."""
    if res.gate is None:  # y = h
        d_mlp, dx = gated_feed_forward_bwd(res.mlp, dy)
        return {"shared": d_mlp}, dx
    # return s * h
    dh = (res.s * dy).astype(res.h.dtype)  # (N, D)
    ds = jnp.sum(dy * res.h, axis=-1, keepdims=True)  # (N, 1)
    dg = ds * res.s * (1 - res.s)  # s = sigmoid(g)
    d_gate, dx_gate = linear_bwd(res.gate, dg)  # g = x @ shared_gate
    d_mlp, dx = gated_feed_forward_bwd(res.mlp, dh)  # h = gated_feed_forward(shared, x)
    return {"shared": d_mlp, "shared_gate": d_gate["w"]}, dx + dx_gate
