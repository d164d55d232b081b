"""Ring attention's hand-derived backward: the pair of jaxformer/model/parallel/ring.py (its
forward's lines are quoted from there), FlashAttention-2's backward walked around the ring.

Forward, on device i of the context axis (c devices), per visit of device j's chunk:
    S = q k_j^T / sqrt(Dh), masked (global positions, documents)   ring.pair_scores
    (m, l, acc) <- online_softmax_step(...)                        blockwise.online_softmax_step
    O = acc / l;  lse = m + log l                                  after the c visits
Backward, with P = exp(S - lse) recomputed one visit at a time (the forward's blocks: ``visited``):
    D   = rowsum(dO * O)              = rowsum(dP * P), the softmax's correction (once, before the ring)
    dV_j += P^T dO                    undoes O = P v   (the online sums' rescalings cancel: O = sum_j P_j v_j)
    dP   = dO v_j^T
    dS   = P * (dP - D)               undoes P = softmax(S) over all c chunks' keys
    dS  *= 1 - (S / softcap)^2        undoes S = softcap tanh(S / softcap), the capped S recomputed
    dq  += dS k_j / sqrt(Dh),  dK_j += dS^T q / sqrt(Dh)          undo S = q k_j^T / sqrt(Dh)
    dK_j, dV_j of the Hkv heads: the G query heads' sums           undoes k_j = repeat_kv(k_j, G)
dq stays on device i (its queries'); dK_j, dV_j travel WITH chunk j: at step s device i
receives (k_j, v_j, the ids, dK_j, dV_j) from device i - 1, adds its queries' share and
passes them on. After step c - 1 device i holds chunk i + 1's, and one final hop of dK, dV
brings every chunk's gradients home: c - 1 hops of k, v (and the ids), c of dK, dV.

With ``block`` K (the blockwise core) a visit's keys are walked K at a time as the forward folds
them (``over_key_blocks``): dq's share summed over the key blocks, each block's dK, dV kept in
its place; no (rows x T/c) probabilities are ever held.

Statistics and the running gradients stay in stats_dtype (float32 or wider), the products
as the forward's (spec.compute_dtype: the model's compute dtype, or the inputs' own).

The manual shard_map keeps check_vma (JAX's varying/invariant types): every array it carries
is device i's own, varying over the context axis, and the only collectives are the ppermutes
written here. Proven equal to one device's full core, and to automatic differentiation of
the forward, in tests/test_ring_attention.py.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.cores import AttentionSpec, capped_scores, repeat_kv
from jaxformer.model.parallel.context import ring_flash_spec, ring_kwargs
from jaxformer.model.parallel.ring import (CONTEXT, ZIGZAG, chunk_positions, on_mesh, over_key_blocks, pair_mask,
                                           part, ring_attention_fwd_stats, ring_spec, visit_dropout, visit_keys, visited,
                                           walk_back)
from jaxformer.model.parallel.ring_flash import RingFlashRes, ring_flash_bwd, ring_flash_fwd
from jaxformer.model.precision import matmul
from manual_grads.attention import ManualCore, sum_groups
from manual_grads.blockwise import _softmax_correction
from manual_grads.dropout import DropoutRes, dropout_bwd
from manual_grads.softcap import softcap_bwd


class RingAttentionRes(NamedTuple):
    q: jax.Array  # (B, H, T/c, Dh) this device's queries
    k: jax.Array  # (B, Hkv, T/c, Dh) its own key/value chunk (the backward sends it round again)
    v: jax.Array  # (B, Hkv, T/c, Dh)
    out: jax.Array  # (B, H, T/c, Dh) O
    lse: jax.Array  # (B, H, T/c) row log-sum-exp of the scores over all T keys, stats_dtype
    segments: jax.Array | None  # (B, T/c) its tokens' document ids; None: one document
    spec: AttentionSpec  # static: the mask rule, the products' compute dtype, the scores' soft cap
    axis_name: str = CONTEXT  # static; the residual lives within one shard_map
    layout: str = ZIGZAG  # static
    block: int = 0  # static: the keys a visit walks at a time (0: all; the blockwise core's K)
    key: object = None  # the probabilities' dropout key (a PieceKey on a mesh), spec.dropout its rate; None: none


def ring_attention_fwd(q, k, v, causal: bool = True, segments=None, axis_name: str = CONTEXT,
                       layout: str = ZIGZAG, compute_dtype=None, softcap: float = 0.0, window: int = 0,
                       block: int = 0, dropout: float = 0.0, key=None):
    """Inside shard_map: ring_attention with residuals -> (O (B, H, T/c, Dh), RingAttentionRes)."""
    out, lse = ring_attention_fwd_stats(q, k, v, causal=causal, segments=segments, axis_name=axis_name,
                                        layout=layout, compute_dtype=compute_dtype, softcap=softcap, window=window,
                                        block=block, dropout=dropout, key=key)
    spec = ring_spec(causal, compute_dtype, softcap, window, dropout)
    return out, RingAttentionRes(q, k, v, out, lse, segments, spec, axis_name, layout, block, key)


def visit_bwd(grads, q, do, lse, d, q_pos, q_seg, chunk, k_pos, spec: AttentionSpec, where, block: int = 0,
              drop=None):
    """Undoes ``visit``: add the block ``where`` (rows, columns; None: nothing) of the held chunk
    (k, v, ids) to grads = (dq (B, H, T/c, Dh), dK, dV (B, Hkv, T/c, Dh)), all in stats_dtype;
    its keys whole or ``block`` at a time, as the forward folded them; ``drop``: the forward's
    visit_dropout (the same masks drawn again), or None."""
    if where is None:
        return grads
    r, col = where
    dq, dk, dv = grads
    f, cd, Hkv = dq.dtype, spec.compute_dtype, chunk[0].shape[1]
    G, scale = q.shape[1] // Hkv, 1.0 / math.sqrt(q.shape[-1])
    q_r, do_r = part(q, r, 2), part(do, r, 2).astype(f)  # (B, H, rows, Dh)
    lse_r, d_r, qp_r, qs_r = part(lse, r, 2)[..., None], part(d, r, 2)[..., None], q_pos[r], part(q_seg, r, 1)

    def keys_bwd(dq_r, keys):  # one fold of over_key_blocks: these keys' share
        k_b, v_b, kp_b, ks_b = keys
        k_c, v_c = repeat_kv(k_b, G), repeat_kv(v_b, G)  # (B, H, keys, Dh)
        # s = pair_scores(q, repeat_kv(k, G), q_pos, k_pos, spec, q_seg, k_seg): S capped, -inf where masked
        capped = capped_scores(q_r, k_c, spec)  # (B, H, rows, keys)
        mask = pair_mask(qp_r, kp_b, spec, qs_r, ks_b)
        # O = acc / l, acc = sum_j exp(S_j - m) v_j, l = sum_j rowsum exp(S_j - m): P_j = exp(S_j - lse)
        p = jnp.exp(capped - lse_r)
        p = p if mask is None else jnp.where(mask, p, 0.0)
        # acc += drop(exp(S - m)) v (online_softmax_step's drop): the same mask, drawn again
        drop_res = None if drop is None else DropoutRes(*reversed(drop(qp_r, kp_b)))  # (key, rate)
        dv_c = matmul(jnp.swapaxes(dropout_bwd(drop_res, p), -1, -2), do_r, cd)  # O = drop(P) v
        dp = matmul(do_r, jnp.swapaxes(v_c, -1, -2).astype(f), cd)  # (B, H, rows, keys)
        dp = dropout_bwd(drop_res, dp)  # drop(P) = P * keep / (1 - rate)
        ds = p * (dp - d_r)  # P = softmax(S): D = rowsum(dO * O) = rowsum(dP * P) with the dropped O too
        if spec.softcap:  # S = softcap tanh(S / softcap): 1 - tanh^2 from the capped S itself
            ds = softcap_bwd(capped / spec.softcap, ds)
        dq_r = dq_r + matmul(ds, k_c.astype(f), cd) * scale  # S = q k^T / sqrt(Dh)
        dk_c = matmul(jnp.swapaxes(ds, -1, -2), q_r.astype(f), cd) * scale
        # k, v = repeat_kv(k, G), repeat_kv(v, G): each key/value head gets its G query heads' sum
        return dq_r, (sum_groups(dk_c, Hkv), sum_groups(dv_c, Hkv))

    dq_r, (dk_c, dv_c) = over_key_blocks(keys_bwd, jnp.zeros_like(q_r, dtype=f), visit_keys(chunk, k_pos, col), block)
    return dq.at[:, :, r].add(dq_r), dk.at[:, :, col].add(dk_c), dv.at[:, :, col].add(dv_c)


def ring_attention_bwd(res: RingAttentionRes, do):
    """Inside shard_map: dO (B, H, T/c, Dh) of this device's queries -> (dq (B, H, T/c, Dh),
    dk, dv (B, Hkv, T/c, Dh)) of its own tokens."""
    q, k, v, out, lse, segments, spec, axis_name, layout, block, key = res
    causal, f = spec.causal, lse.dtype
    c, i = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    n_local = q.shape[2]
    positions = functools.partial(chunk_positions, T=n_local * c, c=c, layout=layout)
    drop = visit_dropout(spec.dropout, key, n_local * c, block)  # the forward's masks, drawn again
    q_pos = positions(i)
    d = _softmax_correction(do, out)  # (B, H, T/c): D = rowsum(dO * O)
    grads = tuple(jnp.zeros_like(a, dtype=f) for a in (q, k, v))  # dq, dK, dV: device i's own, as q, k, v

    def visit_chunk_bwd(grads, held, j, kind):  # stats = visit(stats, ..., visited(kind)) of chunk j
        return visit_bwd(grads, q, do, lse, d, q_pos, segments, held, positions(j), spec,
                         visited(kind, n_local, causal, layout), block, drop)

    # m, l, acc = walk(visit_chunk, init, (k, v, segments), ...): dK, dV travel with their chunk
    dq, dk, dv = walk_back(visit_chunk_bwd, grads, (k, v, segments), causal, axis_name)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def ring_attention_grads_on_mesh(q, k, v, do, mesh, causal: bool = True, segments=None, axis_name: str = CONTEXT,
                                 layout: str = ZIGZAG, compute_dtype=None, softcap: float = 0.0, window: int = 0,
                                 block: int = 0, dropout: float = 0.0, key=None):
    """q (B, H, T, Dh), k, v (B, Hkv, T, Dh), dO (B, H, T, Dh), segments (B, T) or None, natural
    order -> (dq, dk, dv) in natural order: the manual forward and backward in one shard_map
    over the mesh's ``axis_name`` (jaxformer.model.parallel.ring.ring_attention_on_mesh's pair)."""
    def local(q, k, v, do, segments):
        _, res = ring_attention_fwd(q, k, v, causal, segments, axis_name, layout, compute_dtype, softcap, window, block,
                                    dropout, key)
        return ring_attention_bwd(res, do)
    return on_mesh(local, mesh, (q, k, v, do), segments, axis_name, layout, n_out=3)


def ring_core_fwd(q, k, v, spec, key=None, segments=None, *, blockwise: bool = False):
    """The ring's pair as a manual core (manual_grads/attention.py's ``ManualCore`` signature),
    the forward's ``parallel.context.ring_core``: (O (B, H, T/c, Dh), RingAttentionRes)."""
    return ring_attention_fwd(q, k, v, segments=segments, key=key, **ring_kwargs(spec, blockwise))


def ring_flash_core_fwd(q, k, v, spec, key=None, segments=None):
    """parallel.context.ring_flash_core's pair: the Pallas kernels' ring (ring_flash.py), its
    backward the kernels' own walked round the ring (``ring_flash_bwd``), as the one-device
    Pallas core's pair is the kernels' (manual_grads/attention.py) -> (O, RingFlashRes)."""
    return ring_flash_fwd(q, k, v, segments, ring_flash_spec(spec))


# The pairs of parallel.context.RING_CORES, by ModelConfig.attention_impl.
RING_MANUALS = {"full": ManualCore(ring_core_fwd, ring_attention_bwd, RingAttentionRes),
                "blockwise": ManualCore(functools.partial(ring_core_fwd, blockwise=True), ring_attention_bwd,
                                        RingAttentionRes),
                "pallas": ManualCore(ring_flash_core_fwd, ring_flash_bwd, RingFlashRes)}


RING_RES = (RingAttentionRes, RingFlashRes)  # the ring cores' residual types


def ring_manual_of(config) -> ManualCore:
    """The pair of parallel.context.ring_core_of(config)."""
    return RING_MANUALS[config.attention_impl]


def ring_core_bwd(res, do):
    """The backward of whichever ring core made ``res`` (a RingAttentionRes or a RingFlashRes)."""
    return next(m.bwd for m in RING_MANUALS.values() if isinstance(res, m.res))(res, do)
