"""The shared expert of Qwen2-MoE (config.shared_expert_d_ff > 0): one gated MLP that every token
passes through beside its k routed experts, its output scaled by a sigmoid gate of the token;
x (N, D) -> (N, D):

    s = sigmoid(x @ shared_gate)                              (N, 1)  (1 without shared_expert_gate)
    y_shared = s * ((act(x @ w_gate) * (x @ w_up)) @ w_down)  (N, D)  w_gate, w_up (D, Fs), w_down (Fs, D)

The MoE layer (model/moe.py) adds y_shared to the routed experts' combine, as transformers'
Qwen2MoeSparseMoeBlock: ``y = moe(x) + sigmoid(x @ g) * gated_mlp(x)``. Params, in the block's
``ffn`` slot beside the router and the experts: ``shared`` = {w_gate, w_up, w_down} (the dense
gated MLP's leaves, no biases) and ``shared_gate`` (D, 1). The hand-derived backward is
manual_grads/shared_expert.py.
"""

from __future__ import annotations

import jax

from jaxformer.model.linear import linear
from jaxformer.model.mlp import gated_feed_forward
from jaxformer.model.precision import upcast


def shared_expert(p, x, config):
    """The shared expert's output: x (N, D) -> s * gated_mlp(x) (N, D), s the sigmoid gate
    (none without config.shared_expert_gate)."""
    h = gated_feed_forward(p["shared"], x, config.activation, config.compute_dtype)  # (N, D)
    if not config.shared_expert_gate:
        return h
    s = jax.nn.sigmoid(upcast(linear(x, p["shared_gate"], None, config.compute_dtype)))  # (N, 1)
    return s * h
