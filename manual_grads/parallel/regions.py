"""Each tensor-parallel region's backward, beside the forward line it undoes
(jaxformer/model/parallel/regions.py; Megatron-LM's mappings.py pairs them the same way).
Run inside ``jax.shard_map`` over the same named axis; dy is the cotangent of the region's
output on this device, the result the cotangent of its input.

A value replicated over the axis and read by every device's own part of the layer has a
partial cotangent on each device: the parts add (psum). A value that is the same on every
device has the whole cotangent on each: it passes as it is, or is sliced."""

from __future__ import annotations

import jax

from jaxformer.model.parallel.regions import TENSOR, gather_from_sequence, scatter_to_tensor


def copy_to_tensor_bwd(dy, axis_name: str = TENSOR):
    """Undoes ``x = pcast(x, to="varying")`` (copy_to_tensor): each device's use of x gave part
    of dx, so dx = psum(dy), the same on every device."""
    return jax.lax.psum(dy, axis_name)


def reduce_from_tensor_bwd(dy, axis_name: str = TENSOR):
    """Undoes ``y = psum(x)`` (reduce_from_tensor): y is every device's sum, so each device's
    partial x has the whole dy: dx = dy (cast to per-device, as x was)."""
    return jax.lax.pcast(dy, axis_name, to="varying")


def scatter_to_tensor_bwd(dy, axis: int = -1, axis_name: str = TENSOR):
    """Undoes ``y = dynamic_slice(x, i n, n, axis)`` (scatter_to_tensor, device i's block): the
    blocks' cotangents side by side, dx = all_gather(dy), the same on every device."""
    return jax.lax.all_gather(dy, axis_name, axis=axis % dy.ndim, tiled=True, to="invarying")


def gather_from_tensor_bwd(dy, axis: int = -1, axis_name: str = TENSOR):
    """Undoes ``y = all_gather(x, to="invarying")`` (gather_from_tensor): y is the same on every
    device and so is dy; device i's block x got block i of dy: dx = scatter_to_tensor(dy)."""
    return scatter_to_tensor(dy, axis, axis_name)


def gather_from_sequence_bwd(dy, axis: int = 1, axis_name: str = TENSOR):
    """Undoes ``y = all_gather(x)`` (gather_from_sequence): each device read y with its own
    columns, so its dy is partial; block i of their sum is device i's dx:
    dx = psum_scatter(dy) (reduce-scatter)."""
    return jax.lax.psum_scatter(dy, axis_name, scatter_dimension=axis % dy.ndim, tiled=True)


def reduce_scatter_to_sequence_bwd(dy, axis: int = 1, axis_name: str = TENSOR):
    """Undoes ``y = psum_scatter(x)`` (reduce_scatter_to_sequence): block i of the sum is device
    i's y, so each device's partial x gets every block's dy: dx = all_gather(dy)."""
    return gather_from_sequence(dy, axis, axis_name)
