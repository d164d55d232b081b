"""Data x FSDP (x expert x tensor x context) parallelism from JAX's own sharding: a ``Mesh`` of
devices ("data", "fsdp"), ("data", "fsdp", "expert") when the mesh text names an expert axis,
("data", "fsdp", "expert", "tensor") when it names a tensor axis, and "context" after them when
it names a context axis (the axes before the last named one 1 unless named), and the
``NamedSharding`` of each array on it. jit inserts the collectives (the gradient reduction, the
parameter all-gathers); the MoE layer's token exchange over "expert" is its own
(jaxformer/model/moe_parallel.py, under shard_map), and so are the tensor-parallel blocks' over
"tensor" (jaxformer/model/parallel/tensor.py) and the context-parallel blocks' ring over
"context" (jaxformer/model/parallel/context.py).

- a batch is split along its first axis over every axis but tensor and context:
  PartitionSpec(("data", "fsdp")) or PartitionSpec(("data", "fsdp", "expert")) (outside the MoE
  layers the expert axis is more data parallelism); over "tensor" and "context" it is
  replicated: each device of a tensor group runs its slice of every block on the same rows, each
  device of a context group its part of the same rows' tokens
- the MoE experts (blocks.ffn.w_gate, w_up, w_down: (L, E, ...)) are split over "expert"
  along E; the blocks' column- and row-parallel weights over "tensor" as the tensor-parallel
  block reads them (parallel/tensor.leaf_spec), and the head's w and b along V (parallel/vocab.py);
  every leaf is also split over "fsdp" along its largest other dimension that the fsdp size
  divides (replicated when none does, and on fsdp=1)
- scalars, the step counters and the rng key are replicated
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxformer.model.moe_parallel import EXPERT_WEIGHTS, check_experts_divide
from jaxformer.model.parallel.regions import TENSOR, batch_axes  # batch_axes: every axis but tensor, context
from jaxformer.model.parallel.tensor import leaf_spec as tensor_leaf_spec
from jaxformer.observe.words import plural, verb

AXES = ("data", "fsdp", "expert", "tensor", "context")  # a mesh has the first two, three, four or all five

_ITEM = re.compile(r"^\s*([A-Za-z_]\w*)\s*=\s*(\d+)\s*$")


def parse_mesh(text: str | None) -> dict[str, int]:
    """``"data=2,fsdp=4,expert=2"`` -> {"data": 2, "fsdp": 4, "expert": 2}; "" or None -> {}.
    An axis left out gets the devices the others leave (data) or 1 (fsdp, expert)."""
    if text is None or not str(text).strip():
        return {}
    sizes: dict[str, int] = {}
    for item in str(text).split(","):
        match = _ITEM.match(item)
        if not match:
            raise ValueError(f"malformed mesh {text!r}: expected AXIS=SIZE items separated by "
                             f"commas, e.g. data=2,fsdp=4 or data=2,expert=4 (axes: {', '.join(AXES)})")
        name, size = match.group(1), int(match.group(2))
        if name not in AXES:
            raise ValueError(f"unknown mesh axis {name!r} in {text!r}; axes are {', '.join(AXES)}")
        if name in sizes:
            raise ValueError(f"mesh axis {name!r} given twice in {text!r}")
        if size < 1:
            raise ValueError(f"mesh axis {name} must have a positive size, got {size} in {text!r}")
        sizes[name] = size
    return sizes


def mesh_shape(text: str | None, n_devices: int) -> tuple[int, ...]:
    """(data, fsdp) sizes of the mesh ``text`` over ``n_devices`` devices; (data, fsdp,
    expert) when the text names an expert axis; (data, fsdp, expert, tensor) when it names a
    tensor axis; all five (..., context) when it names a context axis (the axes before it 1
    unless named)."""
    sizes = parse_mesh(text)
    rest = [sizes.get(a, 1) for a in AXES[1:]]  # fsdp, expert, tensor, context
    axes = max([2] + [i + 1 for i, a in enumerate(AXES) if a in sizes])
    named = " x ".join(AXES[:axes])
    if "data" in sizes:
        data = sizes["data"]
    elif n_devices % math.prod(rest) == 0:
        data = n_devices // math.prod(rest)
    else:
        given = " x ".join(f"{a}={sizes[a]}" for a in AXES[1:] if a in sizes)
        raise ValueError(f"mesh {text!r}: {given} does not divide the {plural(n_devices, 'device')}")
    shape = (data, *rest)[:axes]
    if math.prod(shape) != n_devices:
        raise ValueError(f"mesh {text!r} has {named} = {' x '.join(map(str, shape))} = {math.prod(shape)} "
                         f"devices, but {plural(n_devices, 'device')} {verb(n_devices, 'is')} in use")
    return shape


def make_mesh(devices=None, shape: str | tuple[int, ...] | None = None) -> Mesh:
    """A ("data", "fsdp") mesh over ``devices`` (default: all devices of all processes), or
    ("data", "fsdp", "expert") for a three-size shape, ("data", "fsdp", "expert", "tensor") for
    four, and "context" too for five. ``shape``: those sizes or mesh text (``parse_mesh``); default: every device on data."""
    devices = jax.devices() if devices is None else list(devices)
    if shape is None or isinstance(shape, str):
        shape = mesh_shape(shape, len(devices))
    return Mesh(np.array(devices).reshape(shape), AXES[:len(shape)])


def mesh_size(mesh: Mesh) -> tuple[int, ...]:
    """The sizes of ``mesh``'s axes: (data, fsdp), (data, fsdp, expert), (data, fsdp, expert, tensor)
    or all five."""
    return tuple(mesh.shape[a] for a in AXES if a in mesh.axis_names)


def batch_devices(mesh: Mesh) -> int:
    """How many ways the batch splits: the product of ``batch_axes``' sizes."""
    return math.prod(mesh.shape[a] for a in batch_axes(mesh))


def describe(mesh: Mesh) -> str:
    """``"data=2 x fsdp=2 x expert=2"``: the mesh's axes and sizes, for messages (an axis of 1
    that a later axis brought along, expert or tensor, is left out)."""
    last = max(AXES.index(a) for a in mesh.axis_names if a in AXES)
    return " x ".join(f"{a}={mesh.shape[a]}" for a in AXES if a in mesh.axis_names
                      and not (a in ("expert", "tensor") and mesh.shape[a] == 1 and AXES.index(a) < last))


def mesh_shardings(mesh: Mesh) -> tuple[NamedSharding, NamedSharding]:
    """(replicated, batch: split along the first axis over every mesh axis but tensor and context)
    on ``mesh``."""
    return NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec(batch_axes(mesh)))


def leaf_spec(shape: tuple[int, ...], fsdp: int, expert_axis: int | None = None,
              tensor_axis: int | None = None) -> PartitionSpec:
    """Split over "fsdp" along the largest dimension ``fsdp`` divides (the first of
    equal ones); replicated when none does or fsdp is 1. ``expert_axis``: that dimension
    is split over "expert" (an MoE expert leaf) and fsdp takes another; ``tensor_axis``
    likewise over "tensor" (a block's column- or row-parallel weight)."""
    spec = [None] * len(shape)
    if expert_axis is not None:
        spec[expert_axis] = "expert"
    if tensor_axis is not None:
        spec[tensor_axis] = "tensor"
    fits = [(size, -axis) for axis, size in enumerate(shape)
            if size % fsdp == 0 and axis not in (expert_axis, tensor_axis)]
    if fsdp > 1 and fits:
        spec[-max(fits)[1]] = "fsdp"
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def expert_axis(path, shape: tuple[int, ...], expert: int) -> int | None:
    """The E dimension of an MoE expert leaf (blocks.ffn.w_gate / w_up / w_down, (L, E, ...),
    in the params or the optimizer state) on a mesh with expert > 1; None for any other leaf.
    E must divide over the expert axis: a ValueError naming both otherwise."""
    keys = [getattr(k, "key", None) for k in path]
    if expert == 1 or len(shape) != 4 or not keys or keys[-1] not in EXPERT_WEIGHTS or "ffn" not in keys:
        return None
    check_experts_divide(shape[1], expert)
    return 1


def tensor_axis(path, shape: tuple[int, ...], tensor: int) -> int | None:
    """The dimension a block leaf (params["blocks"][section][name], or its optimizer moments)
    splits along over a tensor axis of size ``tensor`` > 1, as the tensor-parallel block reads it
    (parallel/tensor.leaf_spec: output columns or input rows); None for any other leaf, and
    where ``tensor`` does not divide that dimension (the block's shard_map then slices it).
    The head's w (D, V) and b (V,) split along V, as the vocab-parallel head reads them, and
    tok_embed (V, D) along V, as the vocab-parallel embedding does (parallel/vocab.py; where tensor
    does not divide V, they stay whole and it pads them)."""
    keys = [getattr(k, "key", None) for k in path]
    if tensor > 1 and keys[-2:] in (["head", "w"], ["head", "b"]):
        return len(shape) - 1 if shape[-1] % tensor == 0 else None
    if tensor > 1 and keys[-1:] == ["tok_embed"]:  # (V, D): its rows, as the vocab-parallel embedding reads them
        return 0 if shape[0] % tensor == 0 else None
    if tensor == 1 or "blocks" not in keys or keys.index("blocks") + 2 >= len(keys):
        return None
    i = keys.index("blocks")
    name = keys[i + 3] if keys[i + 2] == "shared" and i + 3 < len(keys) else keys[i + 2]  # the shared expert's MLP
    spec = tensor_leaf_spec(keys[i + 1], name, len(shape), kv_split=True)
    axis = next((a for a, name in enumerate(spec) if name == TENSOR), None)
    return axis if axis is not None and shape[axis] % tensor == 0 else None


def tree_shardings(tree, mesh: Mesh):
    """A NamedSharding per leaf of ``tree`` (arrays or ShapeDtypeStructs) by ``leaf_spec``;
    the MoE experts split over "expert" along E on a mesh with that axis, the blocks'
    column- and row-parallel weights over "tensor" on a mesh with that axis."""
    sizes = dict(mesh.shape)
    fsdp, expert, tensor = sizes["fsdp"], sizes.get("expert", 1), sizes.get("tensor", 1)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, leaf_spec(x.shape, fsdp, expert_axis(path, x.shape, expert),
                                                      tensor_axis(path, x.shape, tensor))), tree)


def state_shardings(state, mesh: Mesh):
    """The TrainState's shardings: params and optimizer state by ``tree_shardings``,
    the counters and the rng key replicated."""
    replicated, _ = mesh_shardings(mesh)
    return type(state)(
        step=replicated, params=tree_shardings(state.params, mesh),
        opt_state=tree_shardings(state.opt_state, mesh), data_index=replicated, rng=replicated,
    )


def check_batch_size(batch_size: int, mesh: Mesh) -> None:
    n = batch_devices(mesh)
    if batch_size % n:
        what = "batch shards" if {"tensor", "context"} & set(mesh.axis_names) else "devices"
        raise ValueError(f"batch_size {batch_size} must be divisible by the number of {what} ({n}: "
                         f"mesh {describe(mesh)})")


def local_rows(batch_size: int, mesh: Mesh) -> np.ndarray | None:
    """The rows of a (batch_size, ...) training batch this process places on its own
    devices (sorted); None when it places every row (a single process)."""
    if jax.process_count() == 1:
        return None
    _, split = mesh_shardings(mesh)
    rows = set()
    for index in split.addressable_devices_indices_map((batch_size, 1)).values():
        rows.update(range(batch_size)[index[0]])
    return np.array(sorted(rows), dtype=np.int64)


def put_batch(batch: dict, mesh: Mesh, replicate_short: bool = False) -> dict:
    """The host batch on the mesh, split along the batch axis over every mesh axis. A
    batch that does not divide over the mesh is a ValueError naming both sizes,
    unless ``replicate_short`` (a short evaluation batch, asked for by name): then
    it is replicated. Each process places only the rows of its own devices
    (``make_array_from_callback``), so every process may pass the same global batch."""
    replicated, split = mesh_shardings(mesh)
    n = batch_devices(mesh)
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if value.shape[0] % n and not replicate_short:
            raise ValueError(f"batch {key!r} has {value.shape[0]} rows, which do not divide over the "
                             f"{n} devices of the mesh ({describe(mesh)})")
        sharding = split if value.shape[0] % n == 0 else replicated
        out[key] = jax.make_array_from_callback(value.shape, sharding, lambda index, v=value: v[index])
    return out
