"""Sampling a model split over devices: ``generate --mesh tensor=T[,fsdp=F,expert=E]``.

    mesh = model_mesh("tensor=2")          the first T x F x E devices, a data axis of 1
    params = split_model(params, mesh)     each leaf put as training stores it on that mesh
                                           (training.sharding.tree_shardings)
    generate_many(params, config, ...)     unchanged: jit partitions what it is given

With a tensor axis the blocks' q/k/v, gate and up weights are split by output columns, the
output and down projections by input rows, the embedding's rows and the head's columns by the
vocabulary; the key/value cache the prefill makes follows the key/value weights, split along
its heads (tests/test_tensor_parallel.py checks a device's (L, B, Hkv/t, S, Dh) slice). An fsdp
axis splits the weights' storage (each layer gathered where it runs), an expert axis an MoE
layer's experts. The sampler is jax.jit's, its partitioning XLA's (GSPMD): sampling needs no
backward, so no collective is written by hand here; the compiled program's layout changes
(all-to-alls between the fused q/k/v columns and the heads) are XLA's choice, not Megatron's two
all-reduces a layer. A data or context axis would split the batch or the sequence, which one
prompt's sampler does not: refused in one line.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh

from jaxformer.training.sharding import make_mesh, parse_mesh, tree_shardings

MODEL_AXES = ("fsdp", "expert", "tensor")  # the axes that split the model; data and context split the batch


def model_mesh(text: str, devices=None) -> Mesh:
    """The mesh ``text`` names ("tensor=2", "fsdp=2,tensor=2") over the first devices it needs
    of ``devices`` (default: jax.devices()), its data axis 1. ValueError in one line for a
    data or context axis, or more devices than there are."""
    sizes = parse_mesh(text)
    batch = [f"{a}={n}" for a, n in sizes.items() if a not in MODEL_AXES and n > 1]
    if batch:
        raise ValueError(f"mesh {text!r}: sampling splits the model, not the batch or the sequence "
                         f"({', '.join(batch)}); use tensor=T (heads, MLP, vocabulary, key/value cache), "
                         "fsdp=F (the weights' storage) or expert=E")
    devices = list(jax.devices() if devices is None else devices)
    n = math.prod(sizes.get(a, 1) for a in MODEL_AXES)
    if n > len(devices):
        raise ValueError(f"mesh {text!r} needs {n} devices; {len(devices)} in use")
    return make_mesh(devices[:n], ",".join(["data=1"] + [f"{a}={sizes[a]}" for a in MODEL_AXES if a in sizes]))


def split_model(params, mesh: Mesh):
    """``params`` put on ``mesh`` leaf by leaf as training stores them there (tree_shardings)."""
    return jax.device_put(params, tree_shardings(params, mesh))
