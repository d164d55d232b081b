"""Dropout, and the keys it draws its masks from.

    y = x * keep / (1 - rate),   keep = uniform(key, x.shape) >= rate     (float32 uniforms)

A mask is a function of (key, rate, shape) alone, so the hand-derived backward
regenerates it from the key instead of keeping it. The keys of one step's forward:

    embedding output        fold_in(key, n_layers)
    block l                 k_l = fold_in(key, l)
      attention probs       fold_in(k_l, 0)   (blockwise: then fold_in(., i), fold_in(., j)
                                               for query block i, key block j)
      attention branch      fold_in(k_l, 1)
      feed-forward branch   fold_in(k_l, 2)

key None (or rate 0) is no dropout: evaluation, generation and compare-grads.

A mask is jax.random.uniform's over the whole array, and JAX's threefry is partitionable:
element n's uniform is a hash of (key, n), n its index in the whole array (row-major). So a
device that holds a piece of the array (under shard_map: its batch rows, its heads, its tokens)
draws exactly the whole mask's piece, alone (``PieceKey``, ``keep_mask``): a tensor-parallel
block's dropout equals one device's.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

ATTN_PROBS, ATTN_OUT, FFN_OUT = 0, 1, 2


class Piece(NamedTuple):
    """Where a device's arrays sit in the whole ones its dropout masks cover (under shard_map):
    for the batch rows, the heads, the tokens, the features, the queries and the keys, (the whole
    size, this device's first index, or its (n,) indices one by one: a context axis' tokens), or
    None where the device holds them all. A site's array is the residual stream's or a LoRA
    adapter's input (B, T, D) (rows, tokens, features) or the attention probabilities' (B, H, Tq,
    Tk) (rows, heads, queries, keys: a ring visit's query and key positions; None where the
    device holds every token's, as attention reads them all). ``block`` K > 0: the probabilities'
    masks are the blockwise core's, one (B, H, K, K) mask per (query block, key block) pair
    (``block_pair_key``), and queries and keys (the whole length, global positions one by one)
    name each element's pair (position // K) and its place in the pair's block (position % K)."""
    rows: tuple | None = None
    heads: tuple | None = None
    tokens: tuple | None = None
    features: tuple | None = None
    queries: tuple | None = None
    keys: tuple | None = None
    block: int = 0


class PieceKey(NamedTuple):
    """A dropout key on one device's piece (``Piece``): its masks are the whole masks' piece."""
    key: jax.Array
    piece: Piece


def fold(key, n):
    """fold_in(key, n); a PieceKey's key folded, its piece kept."""
    if isinstance(key, PieceKey):
        return PieceKey(jax.random.fold_in(key.key, n), key.piece)
    return jax.random.fold_in(key, n)


def keep_mask(key, rate, shape):
    """bool (shape): True where the value is kept, each with probability 1 - rate. With a
    PieceKey: the piece of the whole array's mask this device holds (``piece_uniform``)."""
    if isinstance(key, PieceKey):
        u = piece_uniform(key, shape)
    else:
        u = jax.random.uniform(key, shape, jnp.float32)
    return u >= jnp.asarray(rate, jnp.float32)


def piece_uniform(key: PieceKey, shape):
    """jax.random.uniform(key.key, whole, float32)[this device's piece], shape ``shape``, drawn
    alone: the whole array's shape and the piece's first indices from key.piece (the stream's
    (B, T, D): rows, tokens, features; the probabilities' (B, H, Tq, Tk): rows, heads, queries,
    keys). JAX's
    partitionable threefry hashes each element's row-major index n as the two words
    (n >> 32, n mod 2^32) (jax.random's iota_2x32_shape); the uniform is the 23 high bits of
    the two outputs' xor as the mantissa of a float in [1, 2), minus 1."""
    if not jax.config.jax_threefry_partitionable:
        raise ValueError("a dropout mask on one device's piece needs jax_threefry_partitionable (JAX's default); "
                         "it is off")
    axes = {3: ("rows", "tokens", "features"), 4: ("rows", "heads", "queries", "keys")}.get(len(shape))
    if axes is None:
        raise ValueError(f"a dropout mask on one device's piece masks (B, T, D) or (B, H, Tq, Tk) arrays, not {shape}")
    piece, data = key.piece, jax.random.key_data(key.key)
    if len(shape) == 4 and piece.block:  # each element's block pair's key, its place in that pair's block
        K, q_pos, k_pos = piece.block, piece.queries[1], piece.keys[1]
        words = jax.vmap(jax.vmap(lambda i, j: jax.random.key_data(block_pair_key(key.key, i, j)), (None, 0)),
                         (0, None))(q_pos // K, k_pos // K)  # (Tq, Tk, 2)
        data = [jnp.broadcast_to(words[..., w], shape) for w in (0, 1)]
        piece = piece._replace(queries=(K, q_pos % K), keys=(K, k_pos % K), block=0)
    spans = [getattr(piece, a) if a else None for a in axes]
    whole = [n if span is None else span[0] for n, span in zip(shape, spans)]
    strides = [int(np.prod(whole[d + 1:], dtype=np.int64)) if d + 1 < len(whole) else 1 for d in range(len(whole))]
    hi = lo = jnp.zeros(shape, jnp.uint32)
    for d, (span, stride) in enumerate(zip(spans, strides)):
        first = 0 if span is None else span[1]
        if jnp.ndim(first) == 1:  # the device's indices along d one by one (a context axis' zig-zag tokens)
            index = jnp.broadcast_to(jnp.expand_dims(jnp.asarray(first, jnp.uint32),
                                                     [a for a in range(len(shape)) if a != d]), shape)
        else:
            index = jax.lax.broadcasted_iota(jnp.uint32, shape, d) + jnp.asarray(first, jnp.uint32)
        h, l = _mul_wide(index, stride)
        lo = lo + l
        hi = hi + h + (lo < l).astype(jnp.uint32)  # the carry where the low words' sum wrapped
    b1, b2 = threefry2x32_p.bind(data[0], data[1], hi, lo)
    bits = (b1 ^ b2) >> jnp.uint32(32 - 23) | jnp.uint32(np.float32(1.0).view(np.uint32))
    return jax.lax.max(jnp.float32(0), jax.lax.bitcast_convert_type(bits, jnp.float32) - jnp.float32(1))


def _mul_wide(a, b: int):
    """(high, low) uint32 words of a * b, a uint32 array, b a Python int below 2^64: the
    64-bit product's words, the 32 x 32 -> 64 products in 16-bit halves."""
    b_hi, b_lo = b >> 32, b & 0xFFFFFFFF
    a1, a0 = a >> 16, a & 0xFFFF
    c1, c0 = jnp.uint32(b_lo >> 16), jnp.uint32(b_lo & 0xFFFF)
    p00, p01, p10, p11 = a0 * c0, a0 * c1, a1 * c0, a1 * c1  # each below 2^32
    mid = (p00 >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF)  # below 3 * 2^16
    low = (mid << 16) | (p00 & 0xFFFF)
    high = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16) + a * jnp.uint32(b_hi & 0xFFFFFFFF)
    return high, low


def active(rate, key) -> bool:
    """Whether dropout at ``rate`` with ``key`` drops anything: a key, and a rate other than
    0 (a traced rate counts as on). The one rule every dropout site asks."""
    return key is not None and not (isinstance(rate, (int, float)) and not rate)


def dropout(x, rate, key):
    """x * keep / (1 - rate); x itself when not ``active(rate, key)`` (rate may be a traced
    array: the hand-derived backward keeps it in its residuals)."""
    if not active(rate, key):
        return x
    keep = keep_mask(key, rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype)).astype(x.dtype)


def layer_key(key, l):
    """Block l's key (l may be traced: the scan's layer index)."""
    return fold(key, l)


def embed_key(key, n_layers: int):
    """The embedding output's key."""
    return fold(key, n_layers)


def sub_key(key, which: int):
    """One of a block's three dropout keys: ATTN_PROBS, ATTN_OUT or FFN_OUT."""
    return None if key is None else fold(key, which)


def block_pair_key(key, i, j):
    """The key of the attention-probabilities mask of query block i, key block j."""
    return fold(fold(key, i), j)
