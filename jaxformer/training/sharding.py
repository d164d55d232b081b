"""Data x FSDP parallelism from JAX's own sharding: a two-axis ``Mesh`` of devices
("data", "fsdp") and the ``NamedSharding`` of each array on it. jit inserts the
collectives (the gradient reduction, the parameter all-gathers); nothing here
moves data by hand.

- a batch is split along its first axis over both axes: PartitionSpec(("data", "fsdp"))
- each parameter and optimizer-state leaf is split over "fsdp" along its largest
  dimension that the fsdp size divides (replicated when none does, and on fsdp=1)
- scalars, the step counters and the rng key are replicated
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxformer.observe.words import plural, verb

AXES = ("data", "fsdp")
BATCH_SPEC = PartitionSpec(AXES)  # the batch axis over data x fsdp

_ITEM = re.compile(r"^\s*([A-Za-z_]\w*)\s*=\s*(\d+)\s*$")


def parse_mesh(text: str | None) -> dict[str, int]:
    """``"data=2,fsdp=4"`` -> {"data": 2, "fsdp": 4}; "" or None -> {}. An axis left
    out gets the devices the others leave (data) or 1 (fsdp)."""
    if text is None or not str(text).strip():
        return {}
    sizes: dict[str, int] = {}
    for item in str(text).split(","):
        match = _ITEM.match(item)
        if not match:
            raise ValueError(f"malformed mesh {text!r}: expected AXIS=SIZE items separated by "
                             f"commas, e.g. data=2,fsdp=4 (axes: {', '.join(AXES)})")
        name, size = match.group(1), int(match.group(2))
        if name not in AXES:
            raise ValueError(f"unknown mesh axis {name!r} in {text!r}; axes are {', '.join(AXES)}")
        if name in sizes:
            raise ValueError(f"mesh axis {name!r} given twice in {text!r}")
        if size < 1:
            raise ValueError(f"mesh axis {name} must have a positive size, got {size} in {text!r}")
        sizes[name] = size
    return sizes


def mesh_shape(text: str | None, n_devices: int) -> tuple[int, int]:
    """(data, fsdp) sizes of the mesh ``text`` over ``n_devices`` devices."""
    sizes = parse_mesh(text)
    fsdp = sizes.get("fsdp", 1)
    if "data" in sizes:
        data = sizes["data"]
    elif n_devices % fsdp == 0:
        data = n_devices // fsdp
    else:
        raise ValueError(f"mesh {text!r}: fsdp={fsdp} does not divide the {plural(n_devices, 'device')}")
    if data * fsdp != n_devices:
        raise ValueError(f"mesh {text!r} has data x fsdp = {data} x {fsdp} = {data * fsdp} "
                         f"devices, but {plural(n_devices, 'device')} {verb(n_devices, 'is')} in use")
    return data, fsdp


def make_mesh(devices=None, shape: str | tuple[int, int] | None = None) -> Mesh:
    """A ("data", "fsdp") mesh over ``devices`` (default: all devices of all processes).
    ``shape``: (data, fsdp) or mesh text (``parse_mesh``); default: every device on data."""
    devices = jax.devices() if devices is None else list(devices)
    if shape is None or isinstance(shape, str):
        shape = mesh_shape(shape, len(devices))
    return Mesh(np.array(devices).reshape(shape), AXES)


def mesh_size(mesh: Mesh) -> tuple[int, int]:
    """(data, fsdp) sizes of ``mesh``."""
    return mesh.shape["data"], mesh.shape["fsdp"]


def mesh_shardings(mesh: Mesh) -> tuple[NamedSharding, NamedSharding]:
    """(replicated, batch: split along the first axis over data x fsdp) on ``mesh``."""
    return NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, BATCH_SPEC)


def leaf_spec(shape: tuple[int, ...], fsdp: int) -> PartitionSpec:
    """Split over "fsdp" along the largest dimension ``fsdp`` divides (the first of
    equal ones); replicated when none does or fsdp is 1."""
    if fsdp == 1:
        return PartitionSpec()
    fits = [(size, -axis) for axis, size in enumerate(shape) if size % fsdp == 0]
    if not fits:
        return PartitionSpec()
    axis = -max(fits)[1]
    return PartitionSpec(*([None] * axis + ["fsdp"]))


def tree_shardings(tree, mesh: Mesh):
    """A NamedSharding per leaf of ``tree`` (arrays or ShapeDtypeStructs) by ``leaf_spec``."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree_util.tree_map(lambda x: NamedSharding(mesh, leaf_spec(x.shape, fsdp)), tree)


def state_shardings(state, mesh: Mesh):
    """The TrainState's shardings: params and optimizer state by ``tree_shardings``,
    the counters and the rng key replicated."""
    replicated, _ = mesh_shardings(mesh)
    return type(state)(
        step=replicated, params=tree_shardings(state.params, mesh),
        opt_state=tree_shardings(state.opt_state, mesh), data_index=replicated, rng=replicated,
    )


def check_batch_size(batch_size: int, mesh: Mesh) -> None:
    data, fsdp = mesh_size(mesh)
    if batch_size % (data * fsdp):
        raise ValueError(
            f"batch_size {batch_size} must be divisible by the number of devices ({data * fsdp}: "
            f"mesh data={data} x fsdp={fsdp})")


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
    """The host batch on the mesh, split along the batch axis over data x fsdp. A
    batch that does not divide over the mesh is a ValueError naming both sizes,
    unless ``replicate_short`` (a short evaluation batch, asked for by name): then
    it is replicated. Each process places only the rows of its own devices
    (``make_array_from_callback``), so every process may pass the same global batch."""
    replicated, split = mesh_shardings(mesh)
    n = math.prod(mesh_size(mesh))
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if value.shape[0] % n and not replicate_short:
            data, fsdp = mesh_size(mesh)
            raise ValueError(f"batch {key!r} has {value.shape[0]} rows, which do not divide over the "
                             f"{n} devices of the mesh (data={data} x fsdp={fsdp})")
        sharding = split if value.shape[0] % n == 0 else replicated
        out[key] = jax.make_array_from_callback(value.shape, sharding, lambda index, v=value: v[index])
    return out
