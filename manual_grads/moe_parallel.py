"""The expert-parallel MoE layer's hand-derived backward: the pair of
jaxformer/model/moe_parallel.py's ``moe_parallel`` (the forward's lines are quoted from there).

Per device, under shard_map (X the expert axis' size, C the rows per destination, M = N k):
    xs = x[order // k]                        (M, D)
    buf = where(valid, xs[src], 0)            (X, C, D)
    recv = all_to_all(buf, split 0, concat 0) (X, C, D)
    rows = recv.flat[order2]                  (X C, D)
    out = expert_mlp(rows)[inverse2]          (X C, D)
    back = all_to_all(out, split 0, concat 0) (X, C, D)
    ys = back.flat[pos]                       (M, D)
    stats = pmean(moe_stats(...))
Backward, bottom to top:
    dys: as moe_bwd (the combine, the un-sort)
    ys = back.flat[pos]: src and pos are inverse maps between the slots and the valid buffer
        rows, so the transpose of the gather is the gather the other way, zero on padding:
        dback = where(valid, dys[src], 0)
    back = all_to_all(out, split_axis=a, concat_axis=b): the exchange is a permutation of the
        blocks between devices; its transpose sends each block back, all_to_all(split_axis=b,
        concat_axis=a) (here a = b = 0): dout = all_to_all(dback)
    out = ys_local[inverse2]: dys_local = dout.flat[order2]
    the experts as moe.experts_bwd on the received rows; each expert's weights saw the tokens of
        every device with the same expert index: dW = psum over the other mesh axes
    rows = recv.flat[order2]: drecv = drows[inverse2];  recv = all_to_all(buf): dbuf = all_to_all(drecv)
    buf = where(valid, xs[src], 0): dxs = dbuf.flat[pos]
    dx, dlogits, the router: as moe_bwd; stats = pmean over the S devices: each device's
        statistics' cotangent is dstats / S; the router's weight is every device's: psum
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxformer.model.moe import MoeStats, dispatch, moe_stats
from jaxformer.model.moe_parallel import (EXPERT_AXIS, EXPERT_WEIGHTS, Exchange, Received, capacity, expert_mesh,
                                          param_specs, send, send_back)
from jaxformer.model.precision import cast, upcast
from manual_grads import moe as _moe
from manual_grads.activations import activation_fwd
from manual_grads.linear import linear_bwd, wide
from manual_grads.moe import ExpertRes, MoeRes, experts_bwd, grouped_matmul, router_bwd
from manual_grads.shared_expert import shared_expert_bwd, shared_expert_fwd


class LocalRes(NamedTuple):
    """One device's residuals: moe_fwd's (its ExpertRes over the received rows) and the exchange's."""
    moe: MoeRes
    plan: Exchange
    got: Received


@functools.partial(jax.tree_util.register_dataclass, data_fields=["local", "stats", "dstats"],
                   meta_fields=["mesh"])
@dataclasses.dataclass(frozen=True)
class ParallelMoeRes:
    local: LocalRes  # each leaf (S, ...): device s's residuals in row s (S = the mesh's devices)
    stats: MoeStats  # the layer's statistics over all tokens (replicated)
    mesh: jax.sharding.AbstractMesh
    dstats: MoeStats | None = None  # the statistics' cotangents (block_bwd sets them); None: zero

    def _replace(self, **changes) -> ParallelMoeRes:
        return dataclasses.replace(self, **changes)


def experts_fwd(p, rows, sizes, config):
    """The grouped gated MLP on rows (R, D) -> (ys (R, D), ExpertRes), as moe_fwd's expert lines."""
    cd = config.compute_dtype
    gate = grouped_matmul(rows, p["w_gate"], sizes, cd)  # (R, F)
    up = grouped_matmul(rows, p["w_up"], sizes, cd)  # (R, F)
    a, act_res = activation_fwd(config.activation, gate)  # (R, F)
    m = cast(a * up, cd)  # (R, F)
    ys = grouped_matmul(m, p["w_down"], sizes, cd)  # (R, D)
    return ys, ExpertRes(rows, act_res, a, up, m, p["w_gate"], p["w_up"], p["w_down"])


def local_fwd(p, x, config, axes):
    """moe_parallel.moe_local with its residuals: x (..., D) -> ((y, stats), LocalRes)."""
    k, D, cd = config.experts_per_token, x.shape[-1], config.compute_dtype
    x2 = x.reshape(-1, D)  # (N, D)
    n = x2.shape[0]
    n_shards = config.n_experts // p["w_gate"].shape[0]
    logits, router_res, gates, idx, probs, top, top_sum = _moe.router_fwd(p, x2, config)  # as moe_fwd
    d = dispatch(idx, config.n_experts)
    xs = cast(x2[d.order // k], cd)  # (M, D)
    rows, plan, got = send(xs, idx.reshape(-1)[d.order], d.sizes, n_shards, capacity(n, config, n_shards))
    out_rows, experts = experts_fwd(p, rows, got.sizes, config)  # (X C, D)
    ys = send_back(out_rows, plan, got, n_shards)  # (M, D)
    y_slots = ys[d.inverse].reshape(n, k, D)  # (N, k, D)
    y = jnp.einsum("nk,nkd->nd", gates.astype(y_slots.dtype), y_slots)  # (N, D)
    shared_res = None
    if config.shared_expert_d_ff:  # y = y + shared_expert(p, x2, config)
        y_shared, shared_res = shared_expert_fwd(p, x2, config)
        y = y + y_shared
    stats = jax.tree_util.tree_map(lambda s: jax.lax.pmean(s, axes), moe_stats(logits, probs, d.sizes))
    res = MoeRes(router_res, probs, jax.nn.logsumexp(logits, axis=-1), gates, idx, top, top_sum, d, experts,
                 y_slots, stats, shared=shared_res)
    return (y.reshape(x.shape), stats), LocalRes(res, plan, got)


def all_to_all_t(ct, split_axis: int, concat_axis: int):
    """The transpose of all_to_all(a, EXPERT_AXIS, split_axis, concat_axis): each block back
    to the device it came from, the two axes' roles swapped."""
    return jax.lax.all_to_all(ct, EXPERT_AXIS, concat_axis, split_axis)


def exchange_bwd(res: LocalRes, dys):
    """dys (M, D), the sorted slots' cotangents -> (the local experts' dp, dxs (M, D))."""
    plan, got, D = res.plan, res.got, dys.shape[-1]
    n_shards = plan.valid.shape[0]
    # ys = back.flat[pos]  (pos and src inverse on the valid rows; padding rows get zero)
    dback = jnp.where(plan.valid[..., None], dys[plan.src], 0)  # (X, C, D)
    # back = all_to_all(out, split 0, concat 0)
    dout = all_to_all_t(dback, 0, 0).reshape(-1, D)  # (X C, D)
    # out = out_rows[inverse2]: a permutation, undone by order2
    dout_rows = dout[got.order]  # (X C, D)
    dp, drows = experts_bwd(res.moe.experts, got.sizes, dout_rows)
    # rows = recv.flat[order2]
    drecv = drows[got.inverse].reshape(n_shards, -1, D)  # (X, C, D)
    # recv = all_to_all(buf, split 0, concat 0)
    dbuf = all_to_all_t(drecv, 0, 0).reshape(-1, D)  # (X C, D)
    # buf = where(valid, xs[src], 0)
    return dp, dbuf[plan.pos]  # (M, D)


def local_bwd(res: LocalRes, dy, dstats, axes, n_devices: int):
    """One device's backward: dy (..., D), dstats (replicated or None) -> (dp, dx (..., D))."""
    r = res.moe
    n, k, D = r.y_slots.shape
    dy2 = upcast(dy).reshape(n, D)
    # y = einsum("nk,nkd->nd", gates, y_slots)
    dgates = jnp.einsum("nd,nkd->nk", dy2, r.y_slots)  # (N, k)
    dy_slots = r.gates.astype(dy2.dtype)[..., None] * dy2[:, None, :]  # (N, k, D)
    # y_slots = ys[inverse]
    dys = dy_slots.reshape(n * k, D)[r.dispatch.order]  # (M, D)
    dp, dxs = exchange_bwd(res, dys)
    # each expert saw the tokens of every device on its expert index: their gradients add
    others = tuple(a for a in axes if a != EXPERT_AXIS)
    dp = jax.tree_util.tree_map(lambda g: jax.lax.psum(g, others), dp) if others else dp
    # xs = x[order // k]
    dx = dxs[r.dispatch.inverse].reshape(n, k, D).sum(axis=1)  # (N, D)
    # stats = pmean(moe_stats(...)) over the n_devices devices
    local_dstats = None if dstats is None else jax.tree_util.tree_map(lambda s: s / n_devices, dstats)
    dlogits = router_bwd(r._replace(dstats=local_dstats), dgates)  # (N, E)
    d_router, dx_router = linear_bwd(r.router, dlogits)  # logits = x @ router
    dp["router"] = jax.lax.psum(d_router["w"], axes)
    if r.shared is not None:  # y = y + shared_expert(p, x2, config): replicated weights, every device's tokens
        d_shared, dx_shared = shared_expert_bwd(r.shared, dy2)
        dp.update(jax.tree_util.tree_map(lambda g: jax.lax.psum(g, axes), d_shared))
        dx = dx + dx_shared
    return dp, (dx + dx_router).reshape(dy.shape)


def moe_parallel_fwd(p, x, config, mesh):
    """moe_parallel with residuals: x (..., D) -> ((y, MoeStats), ParallelMoeRes)."""
    axes, rows = mesh.axis_names, PartitionSpec(mesh.axis_names)

    def fwd(p, x):
        out, res = local_fwd(p, x, config, axes)
        return out, jax.tree_util.tree_map(lambda a: a[None], res)  # device s's residuals: row s

    (y, stats), res = jax.shard_map(fwd, mesh=mesh, in_specs=(param_specs(p), rows),
                                    out_specs=((rows, PartitionSpec()), rows))(p, x)
    return (y, stats), ParallelMoeRes(res, stats, mesh)


def moe_parallel_bwd(res: ParallelMoeRes, dy):
    """dy (..., D) (and res.dstats) -> ({router, w_gate, w_up, w_down, shared?, shared_gate?}, dx (..., D))."""
    mesh = res.mesh
    axes, rows = mesh.axis_names, PartitionSpec(mesh.axis_names)

    def bwd(local, dy, dstats):
        return local_bwd(jax.tree_util.tree_map(lambda a: a[0], local), dy, dstats, axes, mesh.size)

    names = ("router",) + EXPERT_WEIGHTS + (() if res.local.moe.shared is None else
                                            ("shared",) if res.local.moe.shared.gate is None else ("shared", "shared_gate"))
    return jax.shard_map(bwd, mesh=mesh, in_specs=(rows, rows, PartitionSpec()),
                         out_specs=(param_specs(names), rows))(res.local, dy, res.dstats)


def moe_layer_fwd(p, x, config):
    """The MoE layer's forward with residuals: expert parallel on a trace mesh with an expert
    axis (moe_parallel.expert_mesh), else moe.moe_fwd."""
    mesh = expert_mesh(x, config)
    return _moe.moe_fwd(p, x, config) if mesh is None else moe_parallel_fwd(p, x, config, mesh)


def moe_layer_bwd(res, dy):
    """Undoes moe_layer_fwd."""
    return moe_parallel_bwd(res, dy) if isinstance(res, ParallelMoeRes) else _moe.moe_bwd(res, dy)


def ffn_fwd(p, x, config):
    """The block's feed-forward (manual_grads/moe.py's ffn_fwd), expert parallel where moe_layer_fwd is."""
    return moe_layer_fwd(p, x, config) if config.n_experts else _moe.ffn_fwd(p, x, config)


def ffn_bwd(res, dy, narrow_ok: bool = False):
    """Undoes ffn_fwd (``narrow_ok`` as moe.py's ffn_bwd)."""
    return moe_parallel_bwd(res, wide(dy)) if isinstance(res, ParallelMoeRes) else _moe.ffn_bwd(res, dy, narrow_ok)
