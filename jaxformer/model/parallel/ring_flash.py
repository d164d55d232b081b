"""Ring attention over the Pallas kernels (attention_impl "pallas" on a context axis): ring.py's
walk, each visit one call of the flash-attention forward kernel (jaxformer/kernels/pallas), the
backward's visits one call of its backward kernels; the visits' outputs merged by their rows'
log-sum-exps. A ``jax.custom_vjp`` (``ring_flash_attention``) whose rule is that backward, as
the one-device kernel's (kernels/pallas/entry.py); manual_grads/parallel/ring.py runs the same
pair as the hand-derived source's core.

The zig-zag layout's visits (ring.visited) on device i of c, n = T / 2c tokens a piece:
    own chunk (SELF):  2n queries x 2n keys, causal on the local order: piece i's tokens all
                       precede piece 2c-1-i's, so the local order's causal mask is the global one
    earlier (j < i):   2n queries x n keys (piece j), nothing masked
    later (j > i):     n queries (piece 2c-1-i) x 2n keys, nothing masked
The kernels take as many keys as queries, so a visit of 2n x n folds its two query pieces into
the batch (``fold``: each reads the same n keys, k and v repeated, ``repeat``), and one of n x 2n
its two key pieces (the n queries repeated), whose two results merge as two visits do:
    lse = logaddexp(lse_a, lse_b),   O = e^(lse_a - lse) O_a + e^(lse_b - lse) O_b       (``merge``)
from O = 0, lse = -inf before the first. The contiguous layout's visits are whole T/c x T/c
blocks (causal on the own chunk, nothing masked on an earlier one).

Backward (each visit FlashAttention-2's backward kernels, kernels/pallas/backward.py), given the
rows' GLOBAL O and lse: the kernels' P = exp(S - lse) is then the visit's block of the softmax
over all T keys and their D = rowsum(dO * O) its correction, so a visit's dq, dK, dV are its
share (a folded visit's pieces' shares summed back: ``unfold``, ``apart``). dq stays home,
dK and dV travel with their chunk (ring.walk_back).

Segment ids (packed documents): the kernels take the queries' ids and the keys' apart
(``key_segments``). A sliding window W reads the tokens' global positions: with one, each
token's id goes to the kernels beside its global position (``forward.positioned_ids``, the
chunk's ``ring.chunk_positions``), and each call masks keys W or more positions back by them.
A visit whose keys all lie outside a row's window leaves that row lse = MASK + log(keys) (every
score masked, finite), which the merge weighs e^(MASK - lse) = 0 beside its own chunk's visit,
where the diagonal is always seen. The kernels' block loops skip by local places, which never
skip a key the window sees: a visit's keys precede its queries by at least their local distance.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.kernels.pallas.entry import flash_core_bwd, flash_res
from jaxformer.kernels.pallas.forward import pallas_attention_core, positioned_ids
from jaxformer.model.cores import AttentionSpec
from jaxformer.model.parallel.ring import (CONTEXT, SELF, ZIGZAG, check_context, chunk_positions, part, visited, walk,
                                           walk_back)
from jaxformer.model.precision import stats_dtype


def fold(a, f: int, axis: int):
    """a (B, ..., f n at ``axis``, ...) -> (f B, ..., n, ...): its f pieces along ``axis`` stacked
    into the batch, piece-major (None stays None)."""
    if a is None or f == 1:
        return a
    n = a.shape[axis] // f
    a = jnp.moveaxis(a.reshape(a.shape[:axis] + (f, n) + a.shape[axis + 1:]), axis, 0)  # (f, B, ..., n, ...)
    return a.reshape((f * a.shape[1],) + a.shape[2:])


def unfold(a, f: int, axis: int):
    """Undoes ``fold``: (f B, ..., n, ...) -> (B, ..., f n, ...)."""
    if f == 1:
        return a
    a = jnp.moveaxis(a.reshape((f, a.shape[0] // f) + a.shape[1:]), 0, axis)  # (B, ..., f, n, ...)
    return a.reshape(a.shape[:axis] + (f * a.shape[axis + 1],) + a.shape[axis + 2:])


def repeat(a, f: int):
    """a (B, ...) -> (f B, ...): a once for each of ``fold``'s f pieces (None stays None)."""
    return a if a is None or f == 1 else jnp.concatenate([a] * f)


def apart(a, f: int):
    """(f B, ...) -> (f, B, ...): a folded call's f results apart."""
    return a.reshape((f, a.shape[0] // f) + a.shape[1:])


def merge(out_a, lse_a, out_b, lse_b):
    """Two softmax-attention outputs over disjoint keys -> the one over both:
    lse = logaddexp(lse_a, lse_b), O = e^(lse_a - lse) O_a + e^(lse_b - lse) O_b."""
    lse = jnp.logaddexp(lse_a, lse_b)
    return jnp.exp(lse_a - lse)[..., None] * out_a + jnp.exp(lse_b - lse)[..., None] * out_b, lse


def visit_fwd(q, k, v, q_seg, k_seg, causal: bool, spec: AttentionSpec):
    """q (B, H, rows, Dh), k, v (B, Hkv, keys, Dh), rows and keys n or 2n, their ids (B, rows),
    (B, keys) or None (with a window: ``positioned_ids``, (B, rows, 2) and (B, keys, 2)) ->
    (O (B, H, rows, Dh) in stats_dtype, lse (B, H, rows)): one kernel call."""
    call = functools.partial(pallas_attention_core, block_q=spec.block_q, block_k=spec.block_k,
                             compute_dtype=spec.compute_dtype, window=spec.window)
    rows, keys = q.shape[2], k.shape[2]
    f = stats_dtype(q.dtype)
    if rows >= keys:  # each piece of rows reads the same keys
        r = rows // keys
        out, lse = call(fold(q, r, 2), repeat(k, r), repeat(v, r), causal and r == 1,
                        segments=fold(q_seg, r, 1), key_segments=repeat(k_seg, r))
        return unfold(out.astype(f), r, 2), unfold(lse, r, 2)
    r = keys // rows  # the rows read each piece of keys: r outputs to merge
    out, lse = call(repeat(q, r), fold(k, r, 2), fold(v, r, 2), False, segments=repeat(q_seg, r),
                    key_segments=fold(k_seg, r, 1))
    out, lse = apart(out.astype(f), r), apart(lse, r)
    return functools.reduce(lambda a, b: merge(*a, *b), zip(out[1:], lse[1:]), (out[0], lse[0]))


def visit_bwd(q, k, v, out, lse, do, q_seg, k_seg, causal: bool, spec: AttentionSpec):
    """Undoes ``visit_fwd`` given the rows' global O, lse and dO (B, H, rows, ...) -> this visit's
    (dq (B, H, rows, Dh), dK, dV (B, Hkv, keys, Dh)): one call of the backward kernels."""
    def call(q, k, v, out, lse, do, q_seg, k_seg, causal):
        return flash_core_bwd(flash_res(q, k, v, out, lse, causal, spec.block_q, spec.block_k, spec.compute_dtype,
                                        spec.window, q_seg, k_seg), do)

    rows, keys = q.shape[2], k.shape[2]
    if rows >= keys:  # out, lse = unfold(call(fold(q), repeat(k), repeat(v)))
        r = rows // keys
        dq, dk, dv = call(fold(q, r, 2), repeat(k, r), repeat(v, r), *(fold(a, r, 2) for a in (out, lse, do)),
                          fold(q_seg, r, 1), repeat(k_seg, r), causal and r == 1)
        return unfold(dq, r, 2), apart(dk, r).sum(0), apart(dv, r).sum(0)
    r = keys // rows  # out, lse = merge of call(repeat(q), fold(k), fold(v))'s pieces: each its block of P
    dq, dk, dv = call(repeat(q, r), fold(k, r, 2), fold(v, r, 2), *(repeat(a, r) for a in (out, lse, do)),
                      repeat(q_seg, r), fold(k_seg, r, 1), False)
    return apart(dq, r).sum(0), unfold(dk, r, 2), unfold(dv, r, 2)


def chunk_ids(segments, index, n_local: int, c: int, spec: AttentionSpec, layout: str = ZIGZAG, batch: int = 1):
    """The ids the kernels read for device ``index``'s chunk: its segments (B, T/c) or None, or with
    spec.window each token's id beside its global position (``positioned_ids``, (B, T/c, 2))."""
    if not spec.window:
        return segments
    return positioned_ids(segments, chunk_positions(index, n_local * c, c, layout), batch)


def ring_ids(q, segments, spec: AttentionSpec, axis_name: str, layout: str):
    """Inside shard_map: (this device's queries' ids, ids(segments, j): a held chunk j's ids), as
    ``chunk_ids`` gives them to the kernels; q (B, H, T/c, Dh) names the batch and T/c."""
    ids = functools.partial(chunk_ids, n_local=q.shape[2], c=jax.lax.axis_size(axis_name), spec=spec, layout=layout,
                            batch=q.shape[0])
    return ids(segments, jax.lax.axis_index(axis_name)), ids


class RingFlashRes(NamedTuple):
    q: jax.Array  # (B, H, T/c, Dh) this device's queries
    k: jax.Array  # (B, Hkv, T/c, Dh) its own key/value chunk (the backward sends it round again)
    v: jax.Array  # (B, Hkv, T/c, Dh)
    out: jax.Array  # (B, H, T/c, Dh) O, in q's dtype
    lse: jax.Array  # (B, H, T/c) row log-sum-exp of the scores over all T keys, stats_dtype
    segments: jax.Array | None  # (B, T/c) its tokens' document ids; None: one document
    spec: AttentionSpec  # static: the mask rule, the products' dtype, the kernels' tiles
    axis_name: str = CONTEXT  # static
    layout: str = ZIGZAG  # static


def ring_flash_fwd(q, k, v, segments=None, spec: AttentionSpec = AttentionSpec(), axis_name: str = CONTEXT,
                   layout: str = ZIGZAG):
    """Inside shard_map over ``axis_name``: this device's q (B, H, T/c, Dh), k, v (B, Hkv, T/c,
    Dh) and ids (B, T/c) or None, in ``layout`` -> (O (B, H, T/c, Dh), RingFlashRes): its
    queries' attention over the whole sequence, every visit a kernel call."""
    c, n_local = jax.lax.axis_size(axis_name), q.shape[2]
    check_context(n_local * c, c, axis_name, layout)
    f = stats_dtype(q.dtype)
    q_ids, ids = ring_ids(q, segments, spec, axis_name, layout)

    def visit_chunk(stats, held, j, kind):
        where = visited(kind, n_local, spec.causal, layout)
        if where is None:
            return stats
        (r, col), (k_j, v_j, ids_j) = where, held
        block = visit_fwd(part(q, r, 2), part(k_j, col, 2), part(v_j, col, 2), part(q_ids, r, 1),
                          part(ids(ids_j, j), col, 1), spec.causal and kind == SELF, spec)
        rows = merge(part(stats[0], r, 2), part(stats[1], r, 2), *block)
        return tuple(a.at[:, :, r].set(b) for a, b in zip(stats, rows, strict=True))

    init = (jnp.zeros_like(q, dtype=f), jnp.full_like(q[..., 0], -jnp.inf, dtype=f))  # device i's own, as q
    out, lse = walk(visit_chunk, init, (k, v, segments), spec.causal, axis_name)
    out = out.astype(q.dtype)
    return out, RingFlashRes(q, k, v, out, lse, segments, spec, axis_name, layout)


def ring_flash_bwd(res: RingFlashRes, do):
    """Inside shard_map: dO (B, H, T/c, Dh) of this device's queries -> (dq (B, H, T/c, Dh),
    dk, dv (B, Hkv, T/c, Dh)) of its own tokens."""
    q, k, v, out, lse, segments, spec, axis_name, layout = res
    n_local, f = q.shape[2], lse.dtype
    q_ids, ids = ring_ids(q, segments, spec, axis_name, layout)

    def visit_chunk_bwd(grads, held, j, kind):  # stats = visit_chunk(stats, held, j, kind)
        where = visited(kind, n_local, spec.causal, layout)
        if where is None:
            return grads
        (r, col), (k_j, v_j, ids_j) = where, held
        shares = visit_bwd(part(q, r, 2), part(k_j, col, 2), part(v_j, col, 2), *(part(a, r, 2) for a in (out, lse, do)),
                           part(q_ids, r, 1), part(ids(ids_j, j), col, 1), spec.causal and kind == SELF, spec)
        return tuple(g.at[:, :, w].add(s.astype(f)) for g, w, s in zip(grads, (r, col, col), shares, strict=True))

    grads = tuple(jnp.zeros_like(a, dtype=f) for a in (q, k, v))  # dq, dK, dV: device i's own, as q, k, v
    # out, lse = walk(visit_chunk, init, (k, v, segments), ...): dK, dV travel with their chunk
    dq, dk, dv = walk_back(visit_chunk_bwd, grads, (k, v, segments), spec.causal, axis_name)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def ring_flash_attention(q, k, v, segments=None, spec: AttentionSpec = AttentionSpec(), axis_name: str = CONTEXT,
                         layout: str = ZIGZAG):
    """Inside shard_map over ``axis_name``: softmax(q k^T / sqrt(Dh)) v for this device's queries
    (B, H, T/c, Dh) over the whole sequence, by the Pallas kernels; differentiable (JAX's grad
    runs ``ring_flash_bwd``). ``spec``: causal, compute_dtype, block_q, block_k, window."""
    return ring_flash_fwd(q, k, v, segments, spec, axis_name, layout)[0]


def _fwd_rule(q, k, v, segments, spec, axis_name, layout):
    out, res = ring_flash_fwd(q, k, v, segments, spec, axis_name, layout)
    return out, tuple(res[:6])  # the arrays; spec, axis_name and layout come back as nondiff arguments


def _bwd_rule(spec, axis_name, layout, arrays, do):
    return (*ring_flash_bwd(RingFlashRes(*arrays, spec, axis_name, layout), do), None)  # integer ids: no cotangent


ring_flash_attention.defvjp(_fwd_rule, _bwd_rule)
