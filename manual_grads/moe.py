"""The mixture-of-experts layer's hand-derived backward: the pair of jaxformer/model/moe.py's ``moe``.

Forward (N tokens, E experts, k per token, M = N k slots, F the expert width):
    logits = x @ router;  probs = softmax(logits)                       (N, E)
    gates, idx = route(logits)                                          (N, k)
    xs = x[order // k]                                                  (M, D) sorted by expert
    gate, up = xs @ w_gate[e], xs @ w_up[e];  m = act(gate) * up        (M, F) grouped (ragged_dot)
    ys = m @ w_down[e]                                                  (M, D)
    y_n = sum_j gates[n, j] * ys[inverse[n k + j]]                      (N, D)
    stats = (load, mean_n probs, mean_n logsumexp(logits)^2)            the auxiliary losses' inputs
Backward, bottom to top:
    dgates[n, j] = <dy_n, y_slots[n, j]>;  dy_slots[n, j] = gates[n, j] dy_n
    dys = dy_slots[order]                        the un-sort's transpose is the sort
    dm = dys @ w_down[e]^T (grouped);  dw_down[e] = m_e^T dys_e (the per-group product,
    ragged_dot_general over the ragged row axis); the gated MLP as manual_grads/mlp.py
    dx += (dxs[inverse]).reshape(N, k, D).sum(1) the sort's transpose: each slot back to its token
    top-k: the gradient reaches only the chosen entries (a scatter of dtop into idx)
    topk_softmax: gates = softmax(top)  -> dtop = gates (dgates - sum_j gates dgates)
    softmax_topk: gates = top / s       -> dtop = (dgates - sum_j gates dgates) / s  (s = sum top;
                  without norm_topk_prob gates = top and dtop = dgates), into dprobs
    aux: dprobs += dP / N;  dlogits += dz 2 lse / N * probs
    softmax: dlogits += probs (dprobs - sum_e probs dprobs);  the router as a linear layer
The statistics' cotangents (``dstats``, a MoeStats: the load's is ignored, it has no gradient)
come from the model's auxiliary loss: the block's backward sets them on the residual.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.moe import Dispatch, MoeStats, dispatch, grouped_matmul, moe_stats, route
from jaxformer.model.precision import cast, stats_dtype, upcast
from manual_grads.activations import activation_bwd, activation_fwd
from manual_grads.linear import LinearRes, backward_dtype, linear_bwd, linear_fwd, wide
from manual_grads.mlp import feed_forward_bwd, feed_forward_fwd
from manual_grads.shared_expert import SharedExpertRes, shared_expert_bwd, shared_expert_fwd


class ExpertRes(NamedTuple):
    xs: jax.Array  # (M, D) the sorted slots' tokens, in the compute dtype
    act: NamedTuple  # (M, F) the gate's activation's residual
    a: jax.Array  # (M, F) act(gate)
    up: jax.Array  # (M, F)
    m: jax.Array  # (M, F) act(gate) * up, in the compute dtype
    w_gate: jax.Array  # (E, D, F)
    w_up: jax.Array  # (E, D, F)
    w_down: jax.Array  # (E, F, D)


class MoeRes(NamedTuple):
    router: LinearRes  # x (N, D), router (D, E)
    probs: jax.Array  # (N, E) softmax(logits)
    lse: jax.Array  # (N,) logsumexp(logits)
    gates: jax.Array  # (N, k)
    idx: jax.Array  # (N, k) int, the chosen experts
    top: jax.Array | None  # softmax_topk: (N, k) the chosen probabilities; None: topk_softmax
    top_sum: jax.Array | None  # softmax_topk with norm_topk_prob: (N, 1) sum of top; else None
    dispatch: Dispatch
    experts: ExpertRes
    y_slots: jax.Array  # (N, k, D) each chosen expert's output
    stats: MoeStats
    dstats: MoeStats | None = None  # the statistics' cotangents (block_bwd sets them); None: zero
    shared: SharedExpertRes | None = None  # the shared expert's (shared_expert_d_ff); None: none


def router_fwd(p, x2, config):
    """The router of moe_fwd with what its backward keeps: x2 (N, D) -> (logits (N, E),
    LinearRes, gates (N, k), idx (N, k), probs (N, E), top, top_sum (MoeRes' fields))."""
    logits, router_res = linear_fwd({"w": p["router"]}, x2, config.compute_dtype)  # (N, E)
    logits = upcast(logits)
    gates, idx, probs = route(logits, config)  # (N, k), (N, k), (N, E)
    top = top_sum = None
    if config.router == "softmax_topk":
        top = jnp.take_along_axis(probs, idx, axis=-1)  # (N, k)
        top_sum = jnp.sum(top, axis=-1, keepdims=True) if config.norm_topk_prob else None
    return logits, router_res, gates, idx, probs, top, top_sum


def moe_fwd(p, x, config):
    """x (..., D) -> ((y (..., D), MoeStats), MoeRes)."""
    k, D, cd = config.experts_per_token, x.shape[-1], config.compute_dtype
    x2 = x.reshape(-1, D)  # (N, D)
    n = x2.shape[0]
    logits, router_res, gates, idx, probs, top, top_sum = router_fwd(p, x2, config)
    d = dispatch(idx, config.n_experts)
    xs = cast(x2[d.order // k], cd)  # (M, D)
    gate = grouped_matmul(xs, p["w_gate"], d.sizes, cd)  # (M, F)
    up = grouped_matmul(xs, p["w_up"], d.sizes, cd)  # (M, F)
    a, act_res = activation_fwd(config.activation, gate)  # (M, F)
    m = cast(a * up, cd)  # (M, F)
    ys = grouped_matmul(m, p["w_down"], d.sizes, cd)  # (M, D)
    y_slots = ys[d.inverse].reshape(n, k, D)  # (N, k, D)
    y = jnp.einsum("nk,nkd->nd", gates.astype(y_slots.dtype), y_slots)  # (N, D)
    stats = moe_stats(logits, probs, d.sizes)
    experts = ExpertRes(xs, act_res, a, up, m, p["w_gate"], p["w_up"], p["w_down"])
    res = MoeRes(router_res, probs, jax.nn.logsumexp(logits, axis=-1), gates, idx, top, top_sum, d,
                 experts, y_slots, stats)
    if config.shared_expert_d_ff:  # y = y + shared_expert(p, x2, config)
        y_shared, shared_res = shared_expert_fwd(p, x2, config)
        y, res = y + y_shared, res._replace(shared=shared_res)
    return (y.reshape(x.shape[:-1] + (D,)), stats), res


def grouped_matmul_t(x, dy, sizes, compute_dtype=None):
    """The per-group product x_e^T dy_e: x (M, I), dy (M, O), rows grouped by sizes -> (E, I, O)."""
    out = stats_dtype(jnp.result_type(x, dy))
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    return jax.lax.ragged_dot_general(cast(x, compute_dtype), cast(dy, compute_dtype), sizes, dims,
                                      preferred_element_type=out)


def experts_bwd(res: ExpertRes, sizes, dys):
    """dys (M, D) -> ({w_gate, w_up, w_down}, dxs (M, D))."""
    cd = backward_dtype(res.xs, res.w_gate)
    t = lambda w: jnp.swapaxes(w, 1, 2)  # noqa: E731  (E, I, O) -> (E, O, I)
    # ys = grouped_matmul(m, w_down): dm = dys @ w_down[e]^T, dw_down[e] = m_e^T dys_e
    dm = grouped_matmul(dys, t(res.w_down), sizes, cd)  # (M, F)
    dw_down = grouped_matmul_t(res.m, dys, sizes, cd)  # (E, F, D)
    da, dup = dm * res.up, dm * res.a  # m = act(gate) * up
    dgate = activation_bwd(res.act, da)  # a = act(gate)
    # gate = grouped_matmul(xs, w_gate), up = grouped_matmul(xs, w_up): xs feeds both, the two add
    dxs = grouped_matmul(dgate, t(res.w_gate), sizes, cd) + grouped_matmul(dup, t(res.w_up), sizes, cd)
    dw_gate = grouped_matmul_t(res.xs, dgate, sizes, cd)  # (E, D, F)
    dw_up = grouped_matmul_t(res.xs, dup, sizes, cd)  # (E, D, F)
    dp = {"w_gate": dw_gate.astype(res.w_gate.dtype), "w_up": dw_up.astype(res.w_up.dtype),
          "w_down": dw_down.astype(res.w_down.dtype)}
    return dp, dxs


def router_bwd(res: MoeRes, dgates):
    """dgates (N, k) (and res.dstats) -> dlogits (N, E)."""
    n = res.probs.shape[0]
    rows = jnp.arange(n)[:, None]
    scatter = lambda v: jnp.zeros_like(res.probs).at[rows, res.idx].add(v)  # noqa: E731  top_k's transpose
    dprobs = jnp.zeros_like(res.probs)
    dlogits = jnp.zeros_like(res.probs)
    g_dg = jnp.sum(res.gates * dgates, axis=-1, keepdims=True)  # (N, 1)
    if res.top is None:  # gates = softmax(top), top, idx = top_k(logits, k)
        dlogits = scatter(res.gates * (dgates - g_dg))
    elif res.top_sum is None:  # gates = top, top, idx = top_k(probs, k)
        dprobs = scatter(dgates)
    else:  # gates = top / sum(top), top, idx = top_k(probs, k)
        dprobs = scatter((dgates - g_dg) / res.top_sum)
    if res.dstats is not None:
        # probs: jnp.mean(probs, axis=0);  z: jnp.mean(lse * lse), lse = logsumexp(logits)
        dprobs = dprobs + res.dstats.probs[None, :] / n
        dlogits = dlogits + (res.dstats.z * 2 / n) * res.lse[:, None] * res.probs
    # probs = softmax(logits)
    return dlogits + res.probs * (dprobs - jnp.sum(res.probs * dprobs, axis=-1, keepdims=True))


def moe_bwd(res: MoeRes, dy):
    """dy (..., D) -> ({router, w_gate, w_up, w_down}, dx (..., D))."""
    n, k, D = res.y_slots.shape
    dy2 = upcast(dy).reshape(n, D)
    # y = einsum("nk,nkd->nd", gates, y_slots)
    dgates = jnp.einsum("nd,nkd->nk", dy2, res.y_slots)  # (N, k)
    dy_slots = res.gates.astype(dy2.dtype)[..., None] * dy2[:, None, :]  # (N, k, D)
    # y_slots = ys[inverse]: a permutation, undone by the forward order
    dys = dy_slots.reshape(n * k, D)[res.dispatch.order]  # (M, D)
    dp, dxs = experts_bwd(res.experts, res.dispatch.sizes, dys)
    # xs = x[order // k]: each slot's gradient back to its token, the k slots of a token add
    dx = dxs[res.dispatch.inverse].reshape(n, k, D).sum(axis=1)  # (N, D)
    dlogits = router_bwd(res, dgates)  # (N, E)
    d_router, dx_router = linear_bwd(res.router, dlogits)  # logits = x @ router
    dp["router"] = d_router["w"]
    dx = dx + dx_router
    if res.shared is not None:  # y = y + shared_expert(p, x2, config)
        d_shared, dx_shared = shared_expert_bwd(res.shared, dy2)
        dp.update(d_shared)
        dx = dx + dx_shared
    return dp, dx.reshape(dy.shape)


def ffn_fwd(p, x, config):
    """The block's feed-forward: the MoE layer with n_experts (y is then (y, MoeStats)), else
    manual_grads/mlp.py's. x (..., D) -> (y, res)."""
    if config.n_experts:
        return moe_fwd(p, x, config)
    return feed_forward_fwd(p, x, config.activation, config.compute_dtype)


def ffn_bwd(res, dy, narrow_ok: bool = False):
    """Undoes ffn_fwd: dy (..., D) -> (dp, dx); ``narrow_ok`` as mlp.py's feed_forward_bwd
    (the MoE layer's dx is in its own dtype either way)."""
    if isinstance(res, MoeRes):
        return moe_bwd(res, wide(dy))  # (a norm's Cotangent: the MoE layer reads dy as computed)
    return feed_forward_bwd(res, dy, narrow_ok)


def moe_aux_loss_bwd(stats: MoeStats, config, dloss=1.0) -> MoeStats:
    """The cotangents of the stacked statistics from the model's loss + moe_aux_loss(stats):
        lb = E sum_e mean_l(load) mean_l(probs)  ->  dprobs_l = coef E mean_l(load) / L
        z  = mean_l(z)                            ->  dz_l = coef_z / L"""
    L = stats.z.shape[0]
    dprobs = dloss * config.moe_aux_loss_coef * config.n_experts * jnp.mean(stats.load, axis=0) / L  # (E,)
    dprobs = jnp.broadcast_to(dprobs, stats.probs.shape)
    dz = jnp.full(stats.z.shape, dloss * config.router_z_loss_coef / L, stats.z.dtype)
    return MoeStats(jnp.zeros_like(stats.load), dprobs.astype(stats.probs.dtype), dz)

