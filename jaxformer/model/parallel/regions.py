"""The tensor-parallel regions: each collective named for what it does to the activations,
run inside ``jax.shard_map`` over the named mesh axis (``TENSOR`` unless given). Their
backwards are manual_grads/parallel/regions.py, one beside each, as Megatron-LM's
tensor_parallel/mappings.py pairs them:

    region                       forward                             backward
    copy_to_tensor(x)            x (replicated; now read per device)  psum: each device's part of dx
    reduce_from_tensor(x)        psum(x): the partial products' sum   identity
    scatter_to_tensor(x)         this device's slice of x             all_gather (to every device)
    gather_from_tensor(x)        all_gather(x), the same everywhere   this device's slice
    gather_from_sequence(x)      all_gather(x), read per device       reduce_scatter (psum_scatter)
    reduce_scatter_to_sequence   psum_scatter(x)                      all_gather

A column-parallel product is copy_to_tensor then x @ w[:, my columns]; a row-parallel one
is x[..., my rows] @ w[my rows, :] then reduce_from_tensor. The sequence pair does the same
with the activations split along T between the blocks. ``copy_to_tensor`` is jax.lax.pcast
to "varying": the value is the same, its type says every device now holds its own use of it,
so that JAX's own transpose of it (jax.grad through these regions) is the psum too.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

TENSOR = "tensor"  # the mesh axis the model's matrices split over
CONTEXT = "context"  # the mesh axis the sequence splits over (context parallelism, ring.py)


def axis_size(mesh, name: str) -> int:
    """The size of ``mesh``'s axis ``name`` (1 where it has none)."""
    return dict(mesh.shape).get(name, 1)


def trace_mesh_with(name: str):
    """The trace's mesh (``jax.set_mesh``, or the train step's abstract mesh) when its axis
    ``name`` is larger than 1, else None: the model's blocks then run split over that axis.
    None inside a shard_map over that axis too (the axis manual: its code sees its own part)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis_size(mesh, name) == 1 or name in mesh.manual_axes:
        return None
    return mesh


def batch_axes(mesh) -> tuple[str, ...]:
    """The axes a batch's rows split over on ``mesh`` (a Mesh or AbstractMesh): every axis but
    tensor and context (the devices of a tensor or a context group share their rows)."""
    return tuple(a for a in mesh.axis_names if a not in (TENSOR, CONTEXT))


def token_axes(mesh) -> tuple[tuple[str, ...], PartitionSpec]:
    """(the axes a batch's tokens split over, the (B, T, ...) spec): B over the batch axes, and T
    over the context axis where the mesh has one larger than 1 (its tokens in that axis' zig-zag
    order, parallel/context.py); the one rule the context, tensor and vocabulary splits read."""
    axes = batch_axes(mesh)
    if axis_size(mesh, CONTEXT) > 1:
        return (*axes, CONTEXT), PartitionSpec(axes or None, CONTEXT)
    return axes, PartitionSpec(axes or None)


def _axis(x, axis: int) -> int:
    return axis % x.ndim


def copy_to_tensor(x, axis_name: str = TENSOR):
    """x replicated over ``axis_name`` -> x, each device's copy read by its own part of the layer."""
    return jax.lax.pcast(x, axis_name, to="varying")


def reduce_from_tensor(x, axis_name: str = TENSOR):
    """Each device's partial x -> their sum, on every device (the row-parallel reduction)."""
    return jax.lax.psum(x, axis_name)


def scatter_to_tensor(x, axis: int = -1, axis_name: str = TENSOR):
    """x replicated -> this device's slice of ``axis`` (device i of t: the i-th of t equal blocks)."""
    axis = _axis(x, axis)
    n = x.shape[axis] // jax.lax.axis_size(axis_name)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis_name) * n, n, axis)


def gather_from_tensor(x, axis: int = -1, axis_name: str = TENSOR):
    """Each device's block of ``axis`` -> the blocks side by side, the same on every device."""
    return jax.lax.all_gather(x, axis_name, axis=_axis(x, axis), tiled=True, to="invarying")


def gather_from_sequence(x, axis: int = 1, axis_name: str = TENSOR):
    """Each device's block of ``axis`` (T between sequence-parallel blocks) -> the whole, each
    device then reading it with its own columns (a column-parallel product follows)."""
    return jax.lax.all_gather(x, axis_name, axis=_axis(x, axis), tiled=True)


def reduce_scatter_to_sequence(x, axis: int = 1, axis_name: str = TENSOR):
    """Each device's partial x -> this device's block of ``axis`` of their sum (a row-parallel
    product's reduction, leaving the activations split along T)."""
    return jax.lax.psum_scatter(x, axis_name, scatter_dimension=_axis(x, axis), tiled=True)
