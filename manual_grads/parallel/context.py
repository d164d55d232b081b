"""The context-parallel blocks' hand-derived backward: the pair of
jaxformer/model/parallel/context.py (its forward's lines are quoted from there).

Forward, the sequence split over the context axis (c devices), the rows over the other axes:
    xz = to_zigzag(x)                       a fixed permutation of the T tokens
    x_i = block_l(x_i), l = 0 .. L-1        per device, under one shard_map: manual_grads/block.py's
                                            sequence, its attention the model's around ring attention
                                            (manual_grads/attention.py's pieces, ring_attention_fwd as
                                            the core, the rotary tables at each token's global position)
    y = from_zigzag(yz)
Backward, bottom to top:
    y = from_zigzag(yz):     dyz = to_zigzag(dy)  (a permutation: its transpose is its inverse)
    the blocks:              per device, a reverse scan of the blocks' backward on its T/c tokens:
                             the norms, feed-forward, projections and residual adds as one device's
                             (token by token), the core ring_attention_bwd (dK, dV travel with
                             their chunk), the rotary backward with the forward's tables (each token
                             turned back by its own global angle)
    blocks replicated:       dp = psum(dp_i) over the context axis and the batch axes: each device's
                             gradient is its own tokens' and rows' part
    xz = to_zigzag(x):       dx = from_zigzag(dxz)
No activation is gathered: the only collectives are the ring's ppermutes and the one psum of
each gradient leaf.

The manual shard_maps run with check_vma=False: the transposes are the ones written here (the
psum of each replicated leaf's gradient, the ring's hops), proven equal to one device and to
automatic differentiation of the model's forward in tests/test_context_parallel.py (that
forward keeps JAX's varying/invariant types, so that its own transposes are the same sums).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax.sharding import PartitionSpec

from jaxformer.model.config import ModelConfig
from jaxformer.model.parallel.context import (CONTEXT, RING_CORE, check_context_model, context_size,
                                              local_positions, refuse_adapters, row_axes, stream_spec,
                                              zigzag_or_none)
from jaxformer.model.parallel.regions import TENSOR
from jaxformer.model.parallel.ring import from_zigzag, to_zigzag
from manual_grads.attention import ManualCore, attention_bwd, attention_fwd
from manual_grads.block import (PostBlockRes, PreBlockRes, _branch_fwd, _in_norm_fwd, _post_sublayer_bwd,
                                _post_sublayer_fwd, _sublayer_bwd)
from manual_grads.moe_parallel import ffn_bwd, ffn_fwd
from manual_grads.parallel.ring import RingAttentionRes, ring_attention_bwd, ring_attention_fwd
from manual_grads.parallel.tensor import join_arrays, split_arrays


def ring_core_fwd(q, k, v, spec, key=None, segments=None):
    """The ring's pair as a manual core (manual_grads/attention.py's ``ManualCore`` signature),
    the forward's ``ring_core``: (O (B, H, T/c, Dh), RingAttentionRes)."""
    return ring_attention_fwd(q, k, v, spec.causal, segments)


RING_MANUAL = ManualCore(ring_core_fwd, ring_attention_bwd, RingAttentionRes)


def context_attention_fwd(p, x, config: ModelConfig, segments=None):
    """context_attention with residuals: x (B, T/c, D), device i's tokens -> (y, AttentionRes)."""
    # attention(p, x, config, key, RING_CORE, segments, positions=local_positions(x.shape[1]))
    return attention_fwd(p, x, config, None, segments, local_positions(x.shape[1]), RING_CORE, RING_MANUAL)


def context_attention_bwd(res, dy):
    """dy (B, T/c, D) -> (dp with p's keys: device i's tokens' part, dx (B, T/c, D))."""
    return attention_bwd(res, dy, ring_attention_bwd)


def context_block_fwd(p, x, config: ModelConfig, segments=None):
    """One block on device i: manual_grads/block.py's sequence with the ring's attention
    (no dropout, no tap: refused), x and y device i's (B, T/c, D)."""
    if config.norm == "post":  # x1 = ln1(x + attn(x)); y = ln2(x1 + ffn(x1))
        a, attn_res = context_attention_fwd(p["attn"], x, config, segments)
        x1, ln1_res, drop_attn = _post_sublayer_fwd(p, "attn", "ln1", x, a, config, None, None)
        f, ffn_res = ffn_fwd(p["ffn"], x1, config)
        y, ln2_res, drop_ffn = _post_sublayer_fwd(p, "ffn", "ln2", x1, f, config, None, None)
        return y, PostBlockRes(attn_res, ln1_res, ffn_res, ln2_res, drop_attn, drop_ffn)
    h1, ln1_res = _in_norm_fwd(p, "ln1", x, config, None)  # (B, T/c, D)
    a, attn_res = context_attention_fwd(p["attn"], h1, config, segments)
    a, ln1_post_res, drop_attn = _branch_fwd(p, "ln1_post", a, config, None, None, "attn", h1, p["attn"])
    x1 = x + a
    h2, ln2_res = _in_norm_fwd(p, "ln2", x1, config, None)
    f, ffn_res = ffn_fwd(p["ffn"], h2, config)
    f, ln2_post_res, drop_ffn = _branch_fwd(p, "ln2_post", f, config, None, None, "ffn", h2, p["ffn"])
    y = x1 + f
    return y, PreBlockRes(ln1_res, attn_res, ln2_res, ffn_res, drop_attn, drop_ffn, ln1_post_res, ln2_post_res)


def context_block_bwd(res, dy):
    """dy (B, T/c, D) -> (dp with one layer's keys, device i's tokens' part; dx (B, T/c, D))."""
    if isinstance(res, PostBlockRes):
        # y = ln2(x1 + ffn(x1)); x1 = ln1(x + attn(x))
        d_ln2, d_ffn, dx1 = _post_sublayer_bwd(res.ln2, "ln2", res.drop_ffn, res.ffn, ffn_bwd, "ffn", dy, None)
        d_ln1, d_attn, dx = _post_sublayer_bwd(res.ln1, "ln1", res.drop_attn, res.attn, context_attention_bwd,
                                               "attn", dx1, None)
        return {"ln1": d_ln1, "attn": d_attn, "ln2": d_ln2, "ffn": d_ffn}, dx
    grads = {}
    dx1 = _sublayer_bwd(res, "ffn", ffn_bwd, "ln2", dy, grads, None)  # y = x1 + ffn(ln2(x1))
    dx = _sublayer_bwd(res, "attn", context_attention_bwd, "ln1", dx1, grads, None)  # x1 = x + attn(ln1(x))
    return grads, dx


# ----------------------------------------------------------------------------
# the stacked blocks on a mesh


class ContextBlocksRes(NamedTuple):
    arrays: list  # the per-layer residuals' arrays, (devices, L, ...) each
    rest: tuple  # static: split_arrays' treedef and non-array leaves of one layer's residual
    mesh: object  # static: the mesh
    c: int  # static: the context axis' size


def context_blocks_fwd(blocks, x, config: ModelConfig, mesh, segments=None):
    """context_blocks with residuals: the stacked blocks (L, ...), x (B, T, D) and segments
    (B, T) or None in natural order -> (y (B, T, D) in natural order, ContextBlocksRes)."""
    c = context_size(mesh)
    check_context_model(config, c, x.shape[1], dict(mesh.shape).get(TENSOR, 1))
    refuse_adapters(blocks, c)
    stream, every = stream_spec(mesh), PartitionSpec(mesh.axis_names)
    static = {}

    def step(x, p, segments):
        y, res = context_block_fwd(p, x, config, segments)
        arrays, static["rest"] = split_arrays(res)
        return y, arrays

    def fwd(blocks, x, segments):
        y, arrays = jax.lax.scan(lambda x, p: step(x, p, segments), x, blocks)
        return y, [a[None] for a in arrays]  # device s's residuals: row s

    # x = to_zigzag(x); the blocks on each device's T/c tokens; y = from_zigzag(y)
    y, arrays = jax.shard_map(fwd, mesh=mesh, in_specs=(PartitionSpec(), stream, stream), out_specs=(stream, every),
                              check_vma=False)(blocks, to_zigzag(x, c), zigzag_or_none(segments, c))
    return from_zigzag(y, c), ContextBlocksRes(arrays, static["rest"], mesh, c)


def context_blocks_bwd(res: ContextBlocksRes, dy):
    """dy (B, T, D) in natural order -> (the blocks' gradients (L, ...), dx (B, T, D) in natural order)."""
    mesh, c = res.mesh, res.c
    stream, every = stream_spec(mesh), PartitionSpec(mesh.axis_names)
    summed = (*row_axes(mesh), CONTEXT)

    def step(dy, arrays):
        dp, dx = context_block_bwd(join_arrays(arrays, res.rest), dy)
        return dx, dp

    def bwd(arrays, dy):
        dx, grads = jax.lax.scan(step, dy, [a[0] for a in arrays], reverse=True)
        # in_specs=(PartitionSpec(), ...): the blocks replicated, each device's use of them its
        # tokens' and rows' part of their gradient: the whole is the sum over every such device
        grads = jax.tree_util.tree_map(lambda g: jax.lax.psum(g, summed), grads)
        return grads, dx

    # y = from_zigzag(yz): a permutation of T, whose transpose is its inverse: dyz = to_zigzag(dy)
    grads, dxz = jax.shard_map(bwd, mesh=mesh, in_specs=(every, stream), out_specs=(PartitionSpec(), stream),
                               check_vma=False)(res.arrays, to_zigzag(dy, c))
    return grads, from_zigzag(dxz, c)  # xz = to_zigzag(x): dx = from_zigzag(dxz)
