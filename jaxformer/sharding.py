"""Data parallelism from JAX's own sharding: a ``Mesh`` of devices and the
``NamedSharding`` of each array on it. jit inserts the collectives."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def make_mesh(devices=None) -> Mesh:
    """A one-axis ("data") mesh over ``devices`` (default: all visible devices)."""
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.array(devices), ("data",))


def mesh_shardings(mesh: Mesh) -> tuple[NamedSharding, NamedSharding]:
    """(replicated, split along the first axis) shardings on ``mesh``."""
    return NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))


def put_batch(batch: dict, mesh: Mesh) -> dict:
    """The batch on the mesh: split along the batch axis when it divides evenly over the
    devices, replicated otherwise (a short evaluation batch)."""
    replicated, split = mesh_shardings(mesh)
    n = mesh.devices.size
    return {k: jax.device_put(v, split if np.shape(v)[0] % n == 0 else replicated)
            for k, v in batch.items()}
