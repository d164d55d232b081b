"""Tuning the Pallas kernels' GPU launch, an explicit act: time each candidate launch
(tune.CANDIDATES) of the forward and backward kernels at a shape on this process's GPU
and write the fastest to the launch table (tune.py). A traced model only reads that
table; this module is called by ``jaxformer tune`` and by ``jaxformer bench`` before it
times the pallas step, never by the model.

    tune([Shape(T=1024, Dh=64, dtype="bfloat16", causal=True, G=1)])  # on a GPU
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.kernels.pallas import tune as pallas_tune
from jaxformer.kernels.pallas.backward import backward_on
from jaxformer.kernels.pallas.forward import forward_on


def time_step(device: str, q, k, v, do, causal: bool, tuned: pallas_tune.Choice):
    """The forward and backward kernels at the ``tuned`` launch, no platform switch: what
    ``time_on_gpu`` times (q, do (B, H, T, Dh), k, v (B, Hkv, T, Dh) -> dq, dk, dv)."""
    out, lse = forward_on(device, q, k, v, causal=causal, tuned=tuned)
    return backward_on(device, q, k, v, out, lse, do, causal=causal, tuned=tuned)


# The query rows x heads each candidate is timed on: a batch that fills the GPU, as the
# model's own step does (GPT-2 small's B16 x H12 x T1024 is 196,608). On one sequence of 4
# heads the dK/dV kernel ran 64 programs on a 132-processor H200, where only the smallest
# tiles fill the machine; the launch table then held block_q 32 for a step that runs 3,072
# programs, and its attention took 12.7 ms where 64 x 64 tiles had taken 7.9.
TIMED_ROWS = 2 ** 17


def timed_shapes(shape: pallas_tune.Shape, rows: int = TIMED_ROWS) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The q (B, 4 G, T, Dh) and k (B, 4, T, Dh) shapes each candidate is timed on: 4
    key/value heads of G query heads each, and the batch that brings B * 4 G * T to at
    least ``rows`` (1 when one sequence does)."""
    H = 4 * shape.G
    B = max(1, -(-rows // (H * shape.T)))
    return (B, H, shape.T, shape.Dh), (B, 4, shape.T, shape.Dh)


def time_on_gpu(shape: pallas_tune.Shape, c: pallas_tune.Choice, repeats: int = 5) -> float:
    """Seconds of the Triton forward and backward kernels at ``c`` on an attention of
    ``timed_shapes(shape)``, the best of ``repeats`` after a warm-up."""
    def step(q, k, v, do):
        return time_step("gpu", q, k, v, do, shape.causal, c)

    rng, dtype = np.random.default_rng(0), jnp.dtype(shape.dtype)
    q_shape, kv_shape = timed_shapes(shape)
    q, do = (rng.standard_normal(q_shape).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal(kv_shape).astype(dtype) for _ in range(2))
    run = jax.jit(step).lower(q, k, v, do).compile()
    jax.block_until_ready(run(q, k, v, do))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(q, k, v, do))
        best = min(best, time.perf_counter() - start)
    return best


def tune(shapes: Iterable[pallas_tune.Shape], measure=None, *, device_kind: str | None = None,
         path=None, again: bool = False) -> dict[pallas_tune.Shape, pallas_tune.Choice]:
    """{shape: its launch} for each of ``shapes``: the table's entry, or (a shape not in
    it, or every shape with ``again``) the fastest candidate by ``measure(shape, choice)``
    seconds (default ``time_on_gpu``), written to the table at ``path`` (default
    tune.cache_path()) under ``device_kind`` (default this process's GPU). ValueError
    off a GPU when no device kind is given: only a GPU can time Triton's kernels."""
    device_kind = device_kind or pallas_tune.device_kind()
    if device_kind is None:
        raise ValueError(f"tuning the Pallas kernels times them on a GPU; JAX's backend here is "
                         f"{jax.default_backend()!r} (it takes the platform's default tiling)")
    measure = measure or time_on_gpu
    return {shape: pallas_tune.choose(pallas_tune.key(device_kind, shape), functools.partial(measure, shape),
                                      path=path, again=again)
            for shape in dict.fromkeys(shapes)}
