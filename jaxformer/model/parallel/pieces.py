"""Where a device's part of the batch sits in the whole arrays, under shard_map: its rows over
the batch axes (``device_rows``), its tokens in a context axis' zig-zag order
(``local_positions``); and the LoRA sites' dropout keys as that piece (``site_piece_keys``), so
that each device draws its piece of the masks one device draws (dropout.PieceKey).
"""

from __future__ import annotations

import jax

from jaxformer.model.dropout import Piece, PieceKey
from jaxformer.model.lora import LORA
from jaxformer.model.parallel.regions import CONTEXT, axis_size, batch_axes
from jaxformer.model.parallel.ring import chunk_positions


def device_rows(b: int, mesh) -> tuple:
    """(the whole batch's rows, device i's first) of its b rows: the rows split over the batch
    axes of ``mesh``, in their order."""
    rows, n = 0, 1
    for a in batch_axes(mesh):
        rows, n = rows * jax.lax.axis_size(a) + jax.lax.axis_index(a), n * jax.lax.axis_size(a)
    return n * b, rows * b


def local_positions(n_local: int):
    """Inside shard_map over the context axis: (T/c,) int, the global positions of this device's
    n_local tokens (ring.chunk_positions of its axis index, zig-zag)."""
    c = jax.lax.axis_size(CONTEXT)
    return chunk_positions(jax.lax.axis_index(CONTEXT), n_local * c, c)


def device_piece(x, mesh) -> Piece:
    """Inside shard_map over ``mesh``: where device i's x (B/n, T, D), or (B/n, T/c, D) on a
    context axis, sits in the whole (B, T, D) stream: its rows of the batch and, on a context
    axis, its tokens' global positions (zig-zag)."""
    b, n, c = x.shape[0], x.shape[1], axis_size(mesh, CONTEXT)
    return Piece(rows=device_rows(b, mesh), tokens=(n * c, local_positions(n)) if c > 1 else None)


def site_piece_keys(p, x, mesh) -> dict:
    """One layer's params with each LoRA site's dropout key as device i's dropout.PieceKey: its
    rows of the batch and, on a context axis, its tokens (their global positions, zig-zag). x is
    the layer's input on the device: (B/n, T, D), or (B/n, T/c, D) on a context axis (with
    sequence parallelism its T/t tokens, of which the adapters read them all: rows alone). p as it
    is without LoRA dropout. A tensor axis' row-parallel adapters add their features' block
    (parallel/tensor.py's local_adapters)."""
    sections = [s for s, sub in p.items() if isinstance(sub, dict) and "key" in sub.get(LORA, {})]
    if not sections:
        return p
    piece = device_piece(x, mesh)
    out = dict(p)
    for s in sections:
        site = p[s][LORA]
        out[s] = {**p[s], LORA: {**site, "key": PieceKey(site["key"], piece)}}
    return out
