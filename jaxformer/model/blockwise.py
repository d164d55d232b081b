"""Blockwise (flash-style) attention: softmax(q k^T / sqrt(Dh)) v without the (T, T) matrix.

Shape letters: B batch, H heads, T time, Dh head width, K the block size,
N = ceil(T / K) the number of blocks, Tp = N * K the padded length.

q, k and v are padded to Tp and cut into N blocks of K positions. For each query
block i, an online softmax runs over the key blocks j: it keeps the row max m,
the row sum l of exp(s - m) and the unnormalized output acc, rescaling them as
each block raises the max. With ``causal`` the key blocks above the diagonal
(j > i) are skipped by a ``lax.cond``, never computed; padded keys are masked, and so
is every pair the spec refuses (``AttentionSpec.allowed``) and, with segment ids (packed
documents), every pair of two documents (``segment_blocks``: each block's ids beside it). With a sliding window W
(spec.window) query block i walks only the key blocks the window reaches
(``key_blocks``: ceil((W - 1) / K) + 1 of them), so the work is O(T W), not O(T^2). With spec.softcap the
scores are capped, s -> c tanh(s / c), before the mask (``capped_block_scores``).
The forward returns the output and the row log-sum-exp lse = m + log(l), all the
backward (manual_grads/blockwise.py) needs to recompute any block of
probabilities as exp(s - lse).

These pieces are the single definition of the blockwise math: the manual
backward loops over the same blocks with ``block_scores`` and ``if_visible``.
Softmax statistics are kept in at least float32 (``stats_dtype``).

Precision (spec.compute_dtype, ModelConfig's): the two products of each block pair,
q_i k_j^T and P_ij v_j, read their inputs in the compute dtype and accumulate in
float32 or wider (``matmul``); m, l, acc, the output and lse stay in stats_dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxformer.model.cores import AttentionSpec
from jaxformer.model.dropout import active, block_pair_key, dropout
from jaxformer.model.precision import matmul, stats_dtype
from jaxformer.model.softcap import softcap


def n_blocks(T: int, block: int) -> int:
    return -(-T // block)


def to_blocks(x, block: int):
    """(B, H, T, ...) -> (N, B, H, K, ...), zero-padded from T up to Tp = N * K."""
    T = x.shape[2]
    N = n_blocks(T, block)
    pad = [(0, 0)] * x.ndim
    pad[2] = (0, N * block - T)
    x = jnp.pad(x, pad)  # (B, H, Tp, ...)
    x = x.reshape(x.shape[:2] + (N, block) + x.shape[3:])  # (B, H, N, K, ...)
    return jnp.moveaxis(x, 2, 0)  # (N, B, H, K, ...)


def from_blocks(x, T: int):
    """(N, B, H, K, ...) -> (B, H, T, ...), the inverse of to_blocks (padding dropped)."""
    N, B, H, K = x.shape[:4]
    x = jnp.moveaxis(x, 0, 2).reshape((B, H, N * K) + x.shape[4:])  # (B, H, Tp, ...)
    return x[:, :, :T]


def block_size(T: int, block: int) -> int:
    """The block size K used for length T: ``block``, or T when T is shorter (no padding)."""
    return min(block, T)


def if_visible(i, j, spec: AttentionSpec, update, carry):
    """update(carry) when query block i sees any of key block j (always, or 0 <= j <= i when
    causal: ``key_blocks`` may hand a window's j < 0), else carry unchanged: a causal block
    above the diagonal is never computed."""
    if not spec.causal:
        return update(carry)
    visible = (j <= i) & (j >= 0) if spec.window else j <= i
    return jax.lax.cond(visible, update, lambda c: c, carry)


def window_blocks(spec: AttentionSpec, K: int, N: int) -> int:
    """How many key blocks a query block of K rows can see through spec.window W: the block
    holding its first query's first key, i - ceil((W - 1) / K), up to i; N (all) without a window."""
    return min(N, -(-(spec.window - 1) // K) + 1) if spec.window else N


def key_blocks(i, spec: AttentionSpec, K: int, N: int):
    """The key blocks query block i walks, (n,) int: 0 .. N - 1, or with a window the
    window_blocks(spec, K, N) blocks ending at i (some < 0 near the start: if_visible skips
    them; ``clamp`` them to index). So the work is O(T W), not O(T^2)."""
    if not spec.window:
        return jnp.arange(N)
    n = window_blocks(spec, K, N)
    return i - (n - 1) + jnp.arange(n)


def clamp(j, N: int):
    """A key block index from key_blocks made safe to index with (its update is skipped when < 0)."""
    return jnp.clip(j, 0, N - 1)


def capped_block_scores(q_i, k_j, spec: AttentionSpec):
    """q_i, k_j (B, H, K, Dh) -> q_i k_j^T / sqrt(Dh) (B, H, K, K) in stats_dtype, capped to
    softcap * tanh(s / softcap) where spec.softcap is set; unmasked. The product runs in
    spec.compute_dtype."""
    f = stats_dtype(q_i.dtype)
    s = matmul(q_i, jnp.swapaxes(k_j, -1, -2), spec.compute_dtype).astype(f) / math.sqrt(q_i.shape[-1])
    if spec.softcap:
        s = softcap(s, spec.softcap)
    return s  # (B, H, K, K)


def segment_blocks(segments, K: int):
    """segments (B, T) int -> (N, B, 1, K) as to_blocks cuts q (padding -1), or None."""
    if segments is None:
        return None
    return to_blocks(segments[:, None, :, None] + 1, K)[..., 0] - 1


def mask_block(s, i, j, T: int, spec: AttentionSpec, seg=None):
    """The scores s (B, H, K, K) of block pair (i, j), -inf where the key is padding
    (position >= T) or spec.allowed refuses the pair (causal: the future), or with ``seg``
    (query block i's and key block j's segment ids, (B, 1, K) each) where the two differ."""
    K = s.shape[-1]
    q_pos = i * K + jnp.arange(K)[:, None]  # (K, 1)
    k_pos = j * K + jnp.arange(K)[None, :]  # (1, K)
    allowed = k_pos < T
    rule = spec.allowed(q_pos, k_pos)
    if rule is not None:
        allowed = allowed & rule  # (K, K)
    if seg is not None:
        allowed = allowed & (seg[0][..., :, None] == seg[1][..., None, :])  # (B, 1, K, K)
    return jnp.where(allowed, s, -jnp.inf)


def block_scores(q_i, k_j, i, j, T: int, spec: AttentionSpec, seg=None):
    """q_i, k_j (B, H, K, Dh) -> s (B, H, K, K) = q_i k_j^T / sqrt(Dh) in stats_dtype (capped
    with spec.softcap), -inf where mask_block masks the pair (``seg`` as there)."""
    return mask_block(capped_block_scores(q_i, k_j, spec), i, j, T, spec, seg)


def online_softmax_step(carry, s, v_j, compute_dtype=None, drop=None):
    """Fold one key block into the running (m, l, acc) of a query block.

    carry: m (B, H, K) row max so far, l (B, H, K) row sum of exp(s - m),
    acc (B, H, K, Dh) sum of exp(s - m) v; s (B, H, K, K) scores; v_j (B, H, K, Dh).
    A row with every key masked so far keeps m = -inf, l = 0, acc = 0.
    The product exp(s - m) v_j runs in ``compute_dtype``. ``drop`` (rate, key) puts the
    probabilities' dropout on the product only: l sums the undropped exp(s - m).
    """
    m, l, acc = carry
    m_new = jnp.maximum(m, jax.lax.stop_gradient(jnp.max(s, axis=-1)))  # (B, H, K)
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # (B, H, K)
    p = jnp.exp(s - m_safe[..., None])  # (B, H, K, K): 0 where masked
    alpha = jnp.exp(m - m_safe)  # (B, H, K): rescales the old sums; 0 while m = -inf
    l = alpha * l + jnp.sum(p, axis=-1)
    pv = p if drop is None else dropout(p, *drop)  # (B, H, K, K)
    acc = alpha[..., None] * acc + matmul(pv.astype(v_j.dtype), v_j, compute_dtype).astype(acc.dtype)
    return m_new, l, acc


def pair_dropout(rate, key, i, j):
    """The (rate, key) of block pair (i, j)'s probabilities mask, or None (no dropout)."""
    if not active(rate, key):
        return None
    return rate, block_pair_key(key, i, j)


def pair_segments(sb, i, j):
    """(query block i's ids, key block j's ids), (B, 1, K) each, from segment_blocks' sb
    (N, B, 1, K); None without segments. j: an index made safe with ``clamp``."""
    return None if sb is None else (sb[i], sb[j])


def _query_block(q_i, i, kb, vb, T: int, spec: AttentionSpec, key=None, sb=None):
    """One query block i against every visible key block: (out_i (B, H, K, Dh), lse_i (B, H, K)).
    ``sb``: segment_blocks of the segment ids, or None."""
    f = stats_dtype(q_i.dtype)
    row = q_i[..., 0]  # (B, H, K): the *_like arrays vary over a shard_map's axes as q_i does (a tensor axis' heads)
    init = (jnp.full_like(row, -jnp.inf, dtype=f), jnp.zeros_like(row, dtype=f), jnp.zeros_like(q_i, dtype=f))

    N, K = kb.shape[0], q_i.shape[-2]

    def key_step(carry, j):
        def update(c):
            k_j, v_j = kb[clamp(j, N)], vb[clamp(j, N)]  # (B, H, K, Dh)
            s = block_scores(q_i, k_j, i, j, T, spec, pair_segments(sb, i, clamp(j, N)))
            return online_softmax_step(c, s, v_j, spec.compute_dtype, pair_dropout(spec.dropout, key, i, j))

        return if_visible(i, j, spec, update, carry), None

    (m, l, acc), _ = jax.lax.scan(key_step, init, key_blocks(i, spec, K, N))
    # l = 0 only on a padded row whose sliding window holds padding alone: out 0 there, not 0 / 0
    # (dropped by from_blocks, but its NaN would reach JAX's gradient through the division)
    l = jnp.where(l > 0, l, 1.0)
    return (acc / l[..., None]).astype(q_i.dtype), m + jnp.log(l)


def blockwise_attention_core(q, k, v, spec: AttentionSpec, key=None, segments=None):
    """q, k, v (B, H, T, Dh) -> (out (B, H, T, Dh), lse (B, H, T) in stats_dtype).

    out = softmax(q k^T / sqrt(Dh)) v (the pairs spec.allowed refuses masked), computed
    K = spec.block query rows and K keys at a time; lse is each row's log-sum-exp of the
    scores. The products run in spec.compute_dtype (None: the inputs' own dtype). With a
    ``key`` the probabilities go through dropout at spec.dropout, block pair (i, j)'s mask
    drawn from block_pair_key(key, i, j); lse stays that of the undropped scores. ``segments``
    (B, T): each position's document; a query reads only its own document's keys.
    """
    T = q.shape[2]
    K = block_size(T, spec.block)
    qb, kb, vb = to_blocks(q, K), to_blocks(k, K), to_blocks(v, K)  # (N, B, H, K, Dh)
    sb = segment_blocks(segments, K)  # (N, B, 1, K) or None

    def query_step(_, xs):
        q_i, i = xs
        return None, _query_block(q_i, i, kb, vb, T, spec, key, sb)

    _, (ob, lseb) = jax.lax.scan(query_step, None, (qb, jnp.arange(qb.shape[0])))
    return from_blocks(ob, T), from_blocks(lseb, T)


def blockwise(q, k, v, spec: AttentionSpec, key=None, segments=None):
    """The blockwise core: q, k, v (B, H, T, Dh) -> out (B, H, T, Dh), blockwise_attention_core's
    output without its lse (``segments``: (B, T) document ids, or None)."""
    return blockwise_attention_core(q, k, v, spec, key, segments)[0]
