"""Expert parallelism: the MoE layer of moe.py with its experts split over the mesh's "expert"
axis and the tokens exchanged between devices with ``jax.lax.all_to_all`` under ``jax.shard_map``.
Equal to ``moe`` on one device (dropless, exact); x (..., D) -> (y (..., D), MoeStats).

The mesh is the trace's abstract mesh (``jax.sharding.get_abstract_mesh()``): the training step
traces under ``jax.sharding.use_abstract_mesh`` (training/step.py), a caller of the layer may use
``jax.sharding.use_abstract_mesh(mesh.abstract_mesh)`` or ``jax.set_mesh(mesh)``. With an expert
axis of size X > 1 the batch (x's leading axis) is split over every mesh axis and each expert
weight (E, ...) over "expert" along E: device j of the expert axis owns experts j El .. (j+1) El - 1,
El = E / X. Per device (N its tokens, M = N k its slots, C = N min(k, El)):

    logits, gates, idx, probs, order, sizes   as moe(), on the device's own tokens
    xs = x[order // k]                        (M, D) sorted by expert, so grouped by owner
    buf = where(valid, xs[src], 0)            (X, C, D) block j row r: slot offset_j + r (r < count_j)
    recv = all_to_all(buf, split 0, concat 0) (X, C, D) block i: device i's slots for my experts
    rows = recv.flat[order2]                  (X C, D) sorted by my local expert, padding last
    out = expert_mlp(rows)[inverse2]          (X C, D) the grouped matmuls on my El experts
    back = all_to_all(out, split 0, concat 0) (X, C, D) my slots' results, where buf had them
    ys = back.flat[pos]                       (M, D)   pos[s] = j C + s - offset_j, j = owner of s
    y_n = sum_j gates[n, j] ys[inverse[n k + j]]
    stats = pmean(moe_stats(...)) over every mesh axis: the statistics of all the tokens

all_to_all needs static shapes: a token's k experts are distinct, so at most min(k, El) of its
slots go to one device and C = N min(k, El) rows per destination hold any routing. The padded
buffers are X C rows instead of the M = N k the routing needs: X min(k, El) / k times the
one-device layer's slot buffers (xs, the expert activations). Padding rows are zero: with no
biases every expert maps them to zero, their gradients are zero, and no slot reads them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxformer.model.moe import dispatch, expert_mlp, moe, moe_stats, route, router_logits
from jaxformer.model.precision import cast
from jaxformer.model.shared_expert import shared_expert

EXPERT_AXIS = "expert"
EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")  # (E, ...): split over the expert axis along E


class Exchange(NamedTuple):
    """Where a device's sorted slots go: the send buffer's layout and its inverse."""
    src: jax.Array  # (X, C) int: the slot in buffer row (j, r) (clipped where not valid)
    valid: jax.Array  # (X, C) bool: r < the slots sent to device j
    pos: jax.Array  # (M,) int: slot s's row in the flat (X C) buffer
    sizes: jax.Array  # (X, El) int: slots sent to each device's each local expert


class Received(NamedTuple):
    """The rows a device received, sorted by its local experts."""
    order: jax.Array  # (X C,) int: the received rows by local expert (stable), padding last
    inverse: jax.Array  # (X C,) int: argsort(order)
    sizes: jax.Array  # (El,) int: rows per local expert, the grouped matmul's group sizes


def expert_mesh(x, config):
    """The trace's abstract mesh when it has an "expert" axis larger than 1 and x's leading
    axis divides over its devices; None otherwise (the one-device layer). n_experts must divide
    over the expert axis: a ValueError naming both."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or dict(mesh.shape).get(EXPERT_AXIS, 1) == 1:
        return None
    check_experts_divide(config.n_experts, mesh.shape[EXPERT_AXIS])
    return mesh if x.shape[0] % mesh.size == 0 else None


def check_experts_divide(n_experts: int, size: int) -> None:
    """A ValueError naming both unless the n_experts split evenly over an expert axis of ``size``."""
    if n_experts % size:
        raise ValueError(f"n_experts {n_experts} does not divide over the mesh's expert axis (expert={size}): "
                         f"give an expert size that divides {n_experts}")


def param_specs(names) -> dict:
    """The layer's params (``names``: their keys) under shard_map: experts split over "expert"
    along E, the rest replicated."""
    return {name: PartitionSpec(EXPERT_AXIS) if name in EXPERT_WEIGHTS else PartitionSpec() for name in names}


def capacity(n_tokens: int, config, n_shards: int) -> int:
    """C: the most slots one device's n_tokens can send one device (k distinct experts per token)."""
    return n_tokens * min(config.experts_per_token, config.n_experts // n_shards)


def send_plan(sorted_experts, sizes, n_shards: int, cap: int) -> Exchange:
    """sorted_experts (M,) the slots' experts in sorted order, sizes (E,) -> the send layout."""
    m = sorted_experts.shape[0]
    send_sizes = sizes.reshape(n_shards, -1)  # (X, El)
    counts = jnp.sum(send_sizes, axis=1)  # (X,)
    offsets = jnp.cumsum(counts) - counts  # (X,) the first sorted slot of each destination
    r = jnp.arange(cap)
    src = jnp.minimum(offsets[:, None] + r[None, :], m - 1)  # (X, C)
    valid = r[None, :] < counts[:, None]  # (X, C)
    dest = sorted_experts // send_sizes.shape[1]  # (M,) the owner of each slot's expert
    pos = dest * cap + jnp.arange(m) - offsets[dest]  # (M,)
    return Exchange(src, valid, pos, send_sizes)


def receive_plan(recv_sizes, cap: int) -> Received:
    """recv_sizes (X, El): rows from device i for my local expert l -> the local sort."""
    bounds = jnp.cumsum(recv_sizes, axis=1)  # (X, El)
    r = jnp.arange(cap)
    local = jnp.sum(r[None, :, None] >= bounds[:, None, :], axis=-1)  # (X, C): El for padding
    order = jnp.argsort(local.reshape(-1), stable=True)
    return Received(order, jnp.argsort(order), jnp.sum(recv_sizes, axis=0))


def exchange(a):
    """all_to_all over the expert axis: block j of a (X, ...) goes to device j; block i of the
    result came from device i."""
    return jax.lax.all_to_all(a, EXPERT_AXIS, 0, 0)


def send(xs, sorted_experts, sizes, n_shards: int, cap: int):
    """The sorted slots xs (M, D) to their experts' devices -> (rows (X C, D) sorted by local
    expert, Exchange, Received)."""
    plan = send_plan(sorted_experts, sizes, n_shards, cap)
    buf = jnp.where(plan.valid[..., None], xs[plan.src], 0)  # (X, C, D)
    recv = exchange(buf)  # (X, C, D)
    got = receive_plan(exchange(plan.sizes), cap)  # (X, El) counts travel the same way
    return recv.reshape(-1, xs.shape[-1])[got.order], plan, got


def send_back(out_rows, plan: Exchange, got: Received, n_shards: int):
    """The experts' outputs (X C, D) in local-expert order -> each slot's result (M, D) at home."""
    out = out_rows[got.inverse].reshape(n_shards, -1, out_rows.shape[-1])  # (X, C, D)
    back = exchange(out)  # (X, C, D)
    return back.reshape(-1, out_rows.shape[-1])[plan.pos]  # (M, D)


def moe_local(p, x, config, axes):
    """One device's part of the layer (under shard_map): its tokens x (..., D), its experts."""
    k, D, cd = config.experts_per_token, x.shape[-1], config.compute_dtype
    x2 = x.reshape(-1, D)  # (N, D)
    n = x2.shape[0]
    n_shards = config.n_experts // p["w_gate"].shape[0]
    logits = router_logits(p, x2, cd)  # (N, E)
    gates, idx, probs = route(logits, config)  # (N, k)
    d = dispatch(idx, config.n_experts)
    xs = cast(x2[d.order // k], cd)  # (M, D)
    rows, plan, got = send(xs, idx.reshape(-1)[d.order], d.sizes, n_shards, capacity(n, config, n_shards))
    out_rows = expert_mlp(p, rows, got.sizes, config.activation, cd)  # (X C, D)
    ys = send_back(out_rows, plan, got, n_shards)  # (M, D)
    y_slots = ys[d.inverse].reshape(n, k, D)  # (N, k, D)
    y = jnp.einsum("nk,nkd->nd", gates.astype(y_slots.dtype), y_slots)  # (N, D)
    if config.shared_expert_d_ff:  # the shared expert is replicated: each device runs it on its tokens
        y = y + shared_expert(p, x2, config)
    stats = jax.tree_util.tree_map(lambda s: jax.lax.pmean(s, axes), moe_stats(logits, probs, d.sizes))
    return y.reshape(x.shape), stats


def moe_parallel(p, x, config, mesh):
    """The layer on ``mesh``: x's leading axis split over every mesh axis, the experts over "expert"."""
    rows = PartitionSpec(mesh.axis_names)
    local = lambda p, x: moe_local(p, x, config, mesh.axis_names)  # noqa: E731
    return jax.shard_map(local, mesh=mesh, in_specs=(param_specs(p), rows), out_specs=(rows, PartitionSpec()))(p, x)


def moe_layer(p, x, config):
    """The MoE layer: expert parallel on a trace mesh with an expert axis, else moe.moe."""
    mesh = expert_mesh(x, config)
    return moe(p, x, config) if mesh is None else moe_parallel(p, x, config, mesh)
