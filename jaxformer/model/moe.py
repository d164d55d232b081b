"""The mixture-of-experts feed-forward layer (config.n_experts > 0), dropless; x (..., D) -> (..., D).

    logits = x @ router                          (N, E)   N = the tokens, E = n_experts
    probs = softmax(logits)                      (N, E)
    topk_softmax (Mixtral):          top, idx = top_k(logits, k);  gates = softmax(top)
    softmax_topk (Qwen3-MoE, OLMoE): top, idx = top_k(probs, k);   gates = top (/ sum(top) with norm_topk_prob)
    order = argsort(idx.flat)                    (N k,)   the N k (token, choice) slots sorted by expert
    xs = x[order // k]                           (N k, D) each slot's token, grouped by expert
    ys = (act(xs @ w_gate[e]) * (xs @ w_up[e])) @ w_down[e]    grouped matmuls (jax.lax.ragged_dot)
    y_n = sum_j gates[n, j] * ys[inverse[n k + j]]             inverse = argsort(order): the un-sort

Every token reaches its k experts (no capacity, no dropped token): the group sizes are the
bincount of the chosen experts. p = {"router" (D, E), "w_gate", "w_up" (E, D, F), "w_down"
(E, F, D)} (F = expert_d_ff or d_ff; no biases), the block's "ffn" slot; with shared_expert_d_ff
also Qwen2-MoE's shared expert (model/shared_expert.py), whose output y adds.

Beside y the layer returns its router statistics (``MoeStats``); the model averages them over
the layers and adds ``moe_aux_loss`` to the training loss: the load-balancing loss of Switch
and Mixtral (transformers' ``load_balancing_loss_func``, over all layers' tokens at once)
E * sum_e f_e * P_e, f_e the share of tokens routed to e, P_e the mean router probability,
and the router z-loss mean(logsumexp(logits)^2) of ST-MoE. The hand-derived backward is
manual_grads/moe.py.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.activations import activation
from jaxformer.model.linear import linear
from jaxformer.model.precision import cast, stats_dtype, upcast
from jaxformer.model.shared_expert import shared_expert


class MoeStats(NamedTuple):
    """One layer's router statistics (stacked on a leading L axis over the layers)."""

    load: jax.Array  # (E,) count_e / N: tokens routed to expert e per token (sums to k); no gradient
    probs: jax.Array  # (E,) mean over the tokens of softmax(logits)
    z: jax.Array  # () mean over the tokens of logsumexp(logits)^2


class Dispatch(NamedTuple):
    order: jax.Array  # (N k,) int: the slots n k + j sorted by expert (stable)
    inverse: jax.Array  # (N k,) int: argsort(order), the un-sort
    sizes: jax.Array  # (E,) int: slots per expert, the grouped matmul's group sizes


def router_logits(p, x, compute_dtype=None):
    """x (N, D) -> logits (N, E) in float32 or wider."""
    return upcast(linear(x, p["router"], None, compute_dtype))


def route(logits, config):
    """logits (N, E) -> (gates (N, k), idx int (N, k), probs (N, E)) as config.router says.
    Random weights make ties between logits measure-zero: top_k's choice is unique."""
    k = config.experts_per_token
    probs = jax.nn.softmax(logits, axis=-1)  # (N, E)
    if config.router == "topk_softmax":
        top, idx = jax.lax.top_k(logits, k)  # (N, k)
        return jax.nn.softmax(top, axis=-1), idx, probs
    top, idx = jax.lax.top_k(probs, k)  # (N, k)
    if config.norm_topk_prob:
        return top / jnp.sum(top, axis=-1, keepdims=True), idx, probs
    return top, idx, probs


def dispatch(idx, n_experts: int) -> Dispatch:
    """idx int (N, k) -> the slots' order by expert, its inverse, and the group sizes."""
    flat = idx.reshape(-1)  # (N k,)
    order = jnp.argsort(flat, stable=True)
    inverse = jnp.argsort(order)
    return Dispatch(order, inverse, jnp.bincount(flat, length=n_experts))


def grouped_matmul(x, w, sizes, compute_dtype=None):
    """x (M, I) rows grouped by ``sizes`` (E,), w (E, I, O) -> (M, O): group e's rows @ w[e];
    the inputs in ``compute_dtype`` (None: their own), accumulated in float32 or wider."""
    out = stats_dtype(jnp.result_type(x, w))
    return jax.lax.ragged_dot(cast(x, compute_dtype), cast(w, compute_dtype), sizes,
                              preferred_element_type=out)


def expert_mlp(p, xs, sizes, activation_name, compute_dtype=None):
    """Each group's gated MLP: (act(xs @ w_gate[e]) * (xs @ w_up[e])) @ w_down[e]; xs (M, D) -> (M, D)."""
    gate = grouped_matmul(xs, p["w_gate"], sizes, compute_dtype)  # (M, F)
    up = grouped_matmul(xs, p["w_up"], sizes, compute_dtype)  # (M, F)
    return grouped_matmul(activation(activation_name, gate) * up, p["w_down"], sizes, compute_dtype)


def moe_stats(logits, probs, sizes) -> MoeStats:
    """The router statistics of one layer: logits, probs (N, E), sizes (E,)."""
    n = logits.shape[0]
    lse = jax.nn.logsumexp(logits, axis=-1)  # (N,)
    return MoeStats(sizes.astype(probs.dtype) / n, jnp.mean(probs, axis=0), jnp.mean(lse * lse))


def moe(p, x, config):
    """The MoE layer: x (..., D) -> (y (..., D), MoeStats)."""
    k, D = config.experts_per_token, x.shape[-1]
    x2 = x.reshape(-1, D)  # (N, D)
    n = x2.shape[0]
    logits = router_logits(p, x2, config.compute_dtype)  # (N, E)
    gates, idx, probs = route(logits, config)  # (N, k), (N, k), (N, E)
    d = dispatch(idx, config.n_experts)
    xs = x2[d.order // k]  # (N k, D)
    ys = expert_mlp(p, xs, d.sizes, config.activation, config.compute_dtype)  # (N k, D)
    y_slots = ys[d.inverse].reshape(n, k, D)  # (N, k, D): the un-sort
    y = jnp.einsum("nk,nkd->nd", gates.astype(y_slots.dtype), y_slots)  # (N, D)
    if config.shared_expert_d_ff:  # Qwen2-MoE: + sigmoid(x @ shared_gate) * gated_mlp(x)
        y = y + shared_expert(p, x2, config)
    return y.reshape(x.shape[:-1] + (D,)), moe_stats(logits, probs, d.sizes)


def ffn_output(out, config):
    """A feed-forward's or block's output as (y, MoeStats or None): MoE layers return both."""
    return out if config.n_experts else (out, None)


def moe_aux_loss(stats: MoeStats, config):
    """The auxiliary loss of stats stacked over the L layers:
    moe_aux_loss_coef * E * sum_e mean_l(load) * mean_l(probs) + router_z_loss_coef * mean_l(z)."""
    lb = config.n_experts * jnp.sum(jnp.mean(stats.load, axis=0) * jnp.mean(stats.probs, axis=0))
    return config.moe_aux_loss_coef * lb + config.router_z_loss_coef * jnp.mean(stats.z)


def moe_metrics(stats: MoeStats, config) -> dict:
    """The run's MoE metrics: the load-balancing loss (k, experts_per_token, when balanced), the z-loss, and
    each expert's share of the routed tokens over all layers (moe/load{e}, sums to 1)."""
    load = jnp.mean(stats.load, axis=0) / config.experts_per_token  # (E,)
    lb = config.n_experts * jnp.sum(jnp.mean(stats.load, axis=0) * jnp.mean(stats.probs, axis=0))
    out = {"moe/balance_loss": lb, "moe/z_loss": jnp.mean(stats.z)}
    out.update({f"moe/load{e}": load[e] for e in range(config.n_experts)})
    return out
