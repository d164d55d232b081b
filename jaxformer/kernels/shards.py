"""A kernel on a mesh: run it per shard of the batch.

A hand-written kernel is one custom call that XLA cannot partition (Mosaic refuses to,
Triton's would be gathered whole onto every device). Attention is independent per
example, so each device runs the kernel on its own rows of the batch. The mesh is the
trace's abstract mesh (``jax.sharding.get_abstract_mesh()``), which the training step
sets (training/step.py traces its step under ``jax.sharding.use_abstract_mesh``): the
kernels room needs no mesh passed in and imports nothing from training.
"""

from __future__ import annotations

import jax


def per_example_shards(f, *args):
    """f(*args), every arg and result batched along axis 0, run per shard of the batch
    when the trace has a mesh: each device calls f on its own rows, split over every
    mesh axis. Without a mesh, or a batch the mesh does not divide, f(*args)."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = () if mesh.empty else tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
    size = 1
    for a in axes:
        size *= dict(mesh.shape)[a]
    if not axes or args[0].shape[0] % size:  # no mesh, or inside a shard_map over every axis already
        return f(*args)
    rows = jax.sharding.PartitionSpec(axes)
    return jax.shard_map(f, mesh=mesh, in_specs=(rows,) * len(args), out_specs=rows,
                         check_vma=False)(*args)


def varying_as(x, shape):
    """x cast to vary over the manual mesh axes ``shape`` varies over (a ShapeDtypeStruct's
    ``manual_axis_type``, as jax.eval_shape gives it inside a shard_map); x as it is outside one."""
    mat = getattr(shape, "manual_axis_type", None)
    axes = tuple(sorted(mat.varying)) if mat is not None else ()
    return jax.lax.pcast(x, axes, to="varying") if axes else x
