"""The feed-forward layer (the MLP), plain or gated; x (..., D) -> (..., D).

    plain: y = act(x @ w_in + b_in) @ w_out + b_out
    gated: y = (act(x @ w_gate + b_gate) * (x @ w_up + b_up)) @ w_down + b_down

The gated layer (config.mlp "gated") is SwiGLU with activation silu, GeGLU with gelu; its
gate and up projections run as one product x @ [w_gate | w_up]. Without biases
(config.bias False) the b_* leaves are absent. The hand-derived backward of each is
manual_grads/mlp.py.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxformer.model.activations import activation
from jaxformer.model.linear import linear
from jaxformer.model.lora import adapted
from jaxformer.model.precision import kept, upcast
from jaxformer.model.quantized import columns


def feed_forward(p, x, activation_name, compute_dtype=None):
    """p = {w_in (D, F), b_in (F,), w_out (F, D), b_out (D,)}; x (..., D) -> (..., D).
    A gated p = {w_gate, w_up (D, F), b_gate, b_up (F,), w_down (F, D), b_down (D,)} runs
    gated_feed_forward."""
    if "w_gate" in p:
        return gated_feed_forward(p, x, activation_name, compute_dtype)
    h = adapted(p, ("w_in",), x, linear(x, p["w_in"], p.get("b_in"), compute_dtype, narrow=True), compute_dtype)
    a = activation(activation_name, upcast(kept(h, compute_dtype)))  # h rounded as autocast returns it
    return adapted(p, ("w_out",), a, linear(a, p["w_out"], p.get("b_out"), compute_dtype), compute_dtype)


def gate_up_weights(p):
    """The gated layer's two input projections side by side: w = [w_gate | w_up] (D, 2F),
    b (2F,) (None without biases)."""
    b = jnp.concatenate([p["b_gate"], p["b_up"]]) if "b_gate" in p else None
    return columns([p["w_gate"], p["w_up"]]), b


def gated_feed_forward(p, x, activation_name, compute_dtype=None):
    """(act(x @ w_gate + b_gate) * (x @ w_up + b_up)) @ w_down + b_down; x (..., D) -> (..., D).
    The gate and up projections are one product x @ [w_gate | w_up]."""
    gu = adapted(p, ("w_gate", "w_up"), x, linear(x, *gate_up_weights(p), compute_dtype, narrow=True), compute_dtype)
    gate, up = jnp.split(kept(gu, compute_dtype), 2, axis=-1)  # (..., F) each, rounded as autocast returns them
    m = activation(activation_name, upcast(gate)) * upcast(up)
    return adapted(p, ("w_down",), m, linear(m, p["w_down"], p.get("b_down"), compute_dtype), compute_dtype)
