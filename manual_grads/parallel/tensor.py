"""The tensor-parallel block's hand-derived backward: the pairs of
jaxformer/model/parallel/tensor.py's layers (the forward's lines are quoted from there).

Per device i of the tensor axis, under shard_map (the sublayers as the model writes them):
    attention    local = attention_local_params(p)      QK-norm scales, unsplit wk/wv through copy_to_tensor
                 h = copy_to_tensor(x)
                 y = reduce_from_tensor(attention(local, h, local_config)) + bo
    feed-forward h = copy_to_tensor(x)
                 y = reduce_from_tensor(feed_forward(local, h)) + b_out (b_down)
Backward, bottom to top:
    y = z + bo:                      dbo = sum(dy) over the leading dims, on every device alike
    z = reduce_from_tensor(y_i):     dy_i = dy (regions.reduce_from_tensor_bwd)
    y_i = attention(local, h):       manual_grads/attention.py's pair on device i's heads: the
                                     local leaves' gradients (wq's, wo's: device i's columns, rows)
    h = copy_to_tensor(x):           dx = psum(dh_i): each device's heads gave part of dx
    local[n] = copy_to_tensor(p[n]): the replicated leaves read per device: dp[n] = psum(dlocal[n])
    local[n] = scatter_to_tensor(p[n]): a whole-projection QK-norm's scales, device i's block:
                                     their gradients all-gathered (the norm's own backward sums
                                     its mean of dxhat * xhat over the axis, as its forward
                                     summed the squares: manual_grads/rms_norm.py)
    local[kv] = kv_columns(...):     ``kv_columns_bwd`` (each query head's columns back to the
                                     key/value head it read), then the psum above
    local[lora] = local_adapters(p[lora]):  ``local_adapters_bwd``: a replicated A or B read per
                                     device gets the psum of its parts, a sliced one the blocks
                                     side by side (scatter_to_tensor_bwd: an all-gather)
The norms and residual adds between the sublayers run on replicated values, their
gradients the same on every device: the block's sequence is manual_grads/block.py's
(its helpers do the norms, the skips and their gradients), the two sublayers swapped
for the pairs below. ``tensor_blocks_fwd`` / ``tensor_blocks_bwd`` scan the stacked blocks
inside one shard_map each; every axis but tensor splits the batch, so every gradient is
then summed over those axes.

With sequence parallelism (``sequence=True``) each sublayer enters with gather_from_sequence and
leaves with reduce_scatter_to_sequence (their backwards: reduce-scatter, all-gather), and the
norms, residual adds and row-parallel biases run on device i's T/t tokens: their gradients are
device i's tokens' part, summed over the tensor axis (``token_sum``) as over the batch axes.

Dropout: each layer's key is device i's piece of one device's (tensor.device_key); the residuals
keep the keys and the backward draws the same masks again (manual_grads/dropout.py).

With n_experts the feed-forward is the MoE layer on each expert's F/t features (moe_fwd / moe_bwd
on moe_local_params): the router and the shared expert's gate are read per device (their
gradients psum'd, copy_to_tensor_bwd); the statistics, the same on every device of the axis, are
pmean'd over the token axes and tensor in the forward, so each device's part of their cotangents
is 1/n of the whole (``tensor_blocks_bwd``).

The manual shard_maps run with check_vma=False: the transposes are the ones written here,
proven equal to one device and to automatic differentiation of the model's forward in
tests/test_tensor_parallel.py (that forward keeps JAX's varying/invariant types, so that
its own transposes are the same collectives).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxformer.model.attention import qk_norm_of
from jaxformer.model.config import ModelConfig
from jaxformer.model.layer_kinds import per_layer
from jaxformer.model.parallel.pieces import site_piece_keys
from jaxformer.model.parallel.regions import TENSOR, token_axes
from jaxformer.model.parallel.context import local_positions, ring_core_of
from jaxformer.model.lora import LORA
from jaxformer.model.parallel.tensor import (KV, MOE_SHARED, adapter_split, attention_local_params, block_specs,
                                             layer_device_key,
                                             check_tensor_blocks, enter, ffn_bias, leave, local_config,
                                             moe_global_stats, moe_local_params,
                                             replicated_kv, ring_on, segments_spec, split_kv,
                                             stream_spec, tensor_qk_norm, tensor_size, with_local_adapters)
from manual_grads.attention import AttentionRes, attention_bwd, attention_fwd
from manual_grads.block import (PostBlockRes, PreBlockRes, _branch_fwd, _branch_keys, _in_norm_fwd,
                                _post_sublayer_bwd, _post_sublayer_fwd, _sublayer_bwd)
from manual_grads.mlp import FeedForwardRes, GatedFeedForwardRes, feed_forward_bwd, feed_forward_fwd
from manual_grads.moe import MoeRes, moe_bwd, moe_fwd
from manual_grads.parallel.ring import RING_RES, ring_core_bwd, ring_manual_of
from manual_grads.parallel.regions import (copy_to_tensor_bwd, gather_from_sequence_bwd, reduce_from_tensor_bwd,
                                           reduce_scatter_to_sequence_bwd, scatter_to_tensor_bwd)
from manual_grads.remat import keeps_inputs


def enter_bwd(dh, sequence: bool):
    """Undoes ``h = enter(x, sequence)``: copy_to_tensor's psum, or gather_from_sequence's
    reduce-scatter (device i's tokens of the sum)."""
    return gather_from_sequence_bwd(dh) if sequence else copy_to_tensor_bwd(dh)


def leave_bwd(dy, sequence: bool):
    """Undoes ``y = leave(y_i, sequence)``: reduce_from_tensor's identity, or
    reduce_scatter_to_sequence's all-gather (every device's partial y_i reads all of dy)."""
    return reduce_scatter_to_sequence_bwd(dy) if sequence else reduce_from_tensor_bwd(dy)


def token_sum(g, sequence: bool):
    """A replicated leaf's gradient from device i's tokens: with sequence parallelism each device
    saw T/t of them, so the whole gradient is their psum; without, every device saw all of them."""
    return jax.tree_util.tree_map(lambda a: jax.lax.psum(a, TENSOR), g) if sequence else g


def bias_grad(dy):
    """Undoes ``y = z + b``, b (D,) broadcast over dy's leading dims: db = their sum."""
    return dy.reshape(-1, dy.shape[-1]).sum(axis=0)


def kv_columns_bwd(dw, n_kv_heads: int, n_heads: int, axis_name: str = TENSOR):
    """Undoes ``kv_columns``: dw (..., (H/t) Dh), this device's query heads' columns -> the
    replicated weight's (..., Hkv Dh) part from this device (psum'd by copy_to_tensor_bwd)."""
    *lead, width = dw.shape
    t = jax.lax.axis_size(axis_name)
    hl = n_heads // t
    dh = width // hl
    # mine = dynamic_slice_in_dim(rep, i H/t, H/t, axis=-2): zero for the other devices' heads
    drep = jnp.zeros((*lead, n_heads, dh), dw.dtype)
    drep = jax.lax.dynamic_update_slice_in_dim(drep, dw.reshape(*lead, hl, dh), jax.lax.axis_index(axis_name) * hl,
                                               axis=-2)  # (..., H, Dh)
    # rep = repeat(w, G, axis=-2): key/value head j gets the sum of the G query heads that read it
    dkv = drep.reshape(*lead, n_kv_heads, n_heads // n_kv_heads, dh).sum(axis=-2)  # (..., Hkv, Dh)
    return dkv.reshape(*lead, n_kv_heads * dh)


def local_adapters_bwd(dp, section: str, kv: tuple[int, int] | None = None) -> dict:
    """Undoes ``local[LORA] = local_adapters(p[LORA], section, kv)`` in a sublayer's gradients dp
    (as they are without a site): each replicated factor read per device gets the psum of its
    parts (copy_to_tensor_bwd), each split one its blocks side by side (scatter_to_tensor_bwd)."""
    if LORA not in dp:
        return dp
    site = {}
    for name, g in dp[LORA].items():
        if not isinstance(g, dict):  # the scale: no gradient
            site[name] = g
            continue
        split = adapter_split(name, section, kv)
        if split == "rows":  # {"a": scatter_to_tensor(A, -2), "b": copy_to_tensor(B)}
            site[name] = {"a": scatter_to_tensor_bwd(g["a"], -2), "b": copy_to_tensor_bwd(g["b"])}
        elif split == "kv":  # {"a": copy_to_tensor(A), "b": kv_columns(copy_to_tensor(B), Hkv, H)}
            site[name] = {"a": copy_to_tensor_bwd(g["a"]), "b": copy_to_tensor_bwd(kv_columns_bwd(g["b"], *kv))}
        else:  # {"a": copy_to_tensor(A), "b": scatter_to_tensor(B, -1)}
            site[name] = {"a": copy_to_tensor_bwd(g["a"]), "b": scatter_to_tensor_bwd(g["b"], -1)}
    return {**dp, LORA: site}


class TensorAttentionRes(NamedTuple):
    attn: AttentionRes  # device i's attention on its heads (local_config), its local weights
    config: ModelConfig  # static: the whole model's (the heads to undo kv_columns)
    bias: bool  # static: the layer has bo
    sequence: bool = False  # static: x and y are device i's T/t tokens


def tensor_attention_fwd(p, x, config: ModelConfig, segments=None, sequence: bool = False, ring: bool = False,
                         key=None):
    """tensor_attention with residuals: x (B, T, D) replicated (``sequence``: device i's
    (B, T/t, D); ``ring``: its (B, T/c, D) of a context axis) -> (y, TensorAttentionRes).
    ``key``: the probabilities' dropout key, device i's piece (a dropout.PieceKey)."""
    t = jax.lax.axis_size(TENSOR)
    local = with_local_adapters(attention_local_params(p, config, t), p, "attn", replicated_kv(config, t))
    h = enter(x, sequence)
    # attention(local, h, local_config, key, segments=segments, **ring_args(ring, T/c, config)): the ring's pair
    core = (local_positions(h.shape[1]), ring_core_of(config), ring_manual_of(config)) if ring else ()
    y, res = attention_fwd(local, h, local_config(config, t), key, segments, *core,
                           qk=tensor_qk_norm(config))  # partial sums
    y = leave(y, sequence)
    return (y + p["bo"] if "bo" in p else y), TensorAttentionRes(res, config, "bo" in p, sequence)


def tensor_attention_bwd(res: TensorAttentionRes, dy, narrow_ok: bool = False):
    """dy (B, T, D) -> (dp with p's keys: device i's slices of the split leaves, dx (B, T, D));
    dx in dy's dtype whatever ``narrow_ok`` allows (the devices' parts are summed in it)."""
    config, t = res.config, jax.lax.axis_size(TENSOR)
    # y = leave(attention(local, enter(x), local_config)) + bo
    ring = isinstance(res.attn.core, RING_RES)  # the ring's core (a context axis beside)
    dp, dh = attention_bwd(res.attn, leave_bwd(dy, res.sequence), ring_core_bwd if ring else None)
    dx = enter_bwd(dh, res.sequence)
    if res.bias:
        dp["bo"] = token_sum(bias_grad(dy), res.sequence)
    # local = attention_local_params(p): the replicated leaves read per device (a whole-projection
    # QK-norm's scales: device i's block of them, scatter_to_tensor)
    read_bwd = (lambda d: scatter_to_tensor_bwd(d, -1)) if qk_norm_of(config).whole else copy_to_tensor_bwd
    for n in ("q_norm", "k_norm"):
        if n in dp:
            dp[n] = jax.tree_util.tree_map(read_bwd, dp[n])
    if not split_kv(config, t):  # local[n] = kv_columns(copy_to_tensor(p[n]), Hkv, H)
        for n in KV:
            if n in dp:
                dp[n] = copy_to_tensor_bwd(kv_columns_bwd(dp[n], config.kv_heads, config.n_heads))
    return local_adapters_bwd(dp, "attn", replicated_kv(config, t)), dx


class TensorFeedForwardRes(NamedTuple):
    ffn: FeedForwardRes | GatedFeedForwardRes | MoeRes  # device i's F/t features (each expert's)
    bias: str | None  # static: the row-parallel bias' name, None without one
    sequence: bool = False  # static: x and y are device i's T/t tokens


def tensor_feed_forward_fwd(p, x, config: ModelConfig, sequence: bool = False):
    """tensor_feed_forward with residuals: x (B, T, D) -> (y (B, T, D), TensorFeedForwardRes);
    with n_experts y is (y, MoeStats), the statistics the same on every device of the axis."""
    if config.n_experts:  # y, stats = moe(moe_local_params(p), enter(x), config); leave(y)
        (y, stats), res = moe_fwd(moe_local_params(p), enter(x, sequence), config)
        return (leave(y, sequence), stats), TensorFeedForwardRes(res, None, sequence)
    bias = ffn_bias(p)
    local = with_local_adapters({n: v for n, v in p.items() if n != bias}, p, "ffn")
    y, res = feed_forward_fwd(local, enter(x, sequence), config.activation, config.compute_dtype)
    y = leave(y, sequence)
    return (y + p[bias] if bias in p else y), TensorFeedForwardRes(res, bias if bias in p else None, sequence)


def tensor_feed_forward_bwd(res: TensorFeedForwardRes, dy, narrow_ok: bool = False):
    """dy (B, T, D) -> (dp with p's keys, dx (B, T, D)); dx in dy's dtype whatever ``narrow_ok``
    allows (the devices' parts are summed in it)."""
    # y = leave(feed_forward(local, enter(x))) + b
    if isinstance(res.ffn, MoeRes):  # y = leave(moe(moe_local_params(p), enter(x)))
        dp, dh = moe_bwd(res.ffn, leave_bwd(dy, res.sequence))
        for n in MOE_SHARED:  # the router and the shared expert's gate, read per device: their parts summed
            if n in dp:
                dp[n] = copy_to_tensor_bwd(dp[n])
        return dp, enter_bwd(dh, res.sequence)
    dp, dh = feed_forward_bwd(res.ffn, leave_bwd(dy, res.sequence))
    if res.bias:
        dp[res.bias] = token_sum(bias_grad(dy), res.sequence)
    return local_adapters_bwd(dp, "ffn"), enter_bwd(dh, res.sequence)


NORMS = ("ln1", "ln2", "ln1_post", "ln2_post")  # a layer's norms: on device i's tokens with sequence parallelism


def tensor_block_fwd(p, x, config: ModelConfig, segments=None, sequence: bool = False, ring: bool = False,
                     key=None):
    """One block on device i: manual_grads/block.py's sequence with the tensor-parallel sublayers
    (``sequence``: x and y device i's T/t tokens; ``ring``: its T/c tokens of a context axis);
    ``key``: the layer's dropout key, device i's piece (tensor.device_key), or None."""
    k_probs, k_attn, k_ffn = _branch_keys(config, key)
    if config.norm == "post":  # x1 = ln1(x + drop(attn(x))); y = ln2(x1 + drop(ffn(x1)))
        a, attn_res = tensor_attention_fwd(p["attn"], x, config, segments, sequence, ring, k_probs)
        x1, ln1_res, drop_attn = _post_sublayer_fwd(p, "attn", "ln1", x, a, config, k_attn, None)
        f, ffn_res = tensor_feed_forward_fwd(p["ffn"], x1, config, sequence)
        f = f[0] if config.n_experts else f  # the MoE layer's statistics stay on ffn_res
        y, ln2_res, drop_ffn = _post_sublayer_fwd(p, "ffn", "ln2", x1, f, config, k_ffn, None)
        return y, PostBlockRes(attn_res, ln1_res, ffn_res, ln2_res, drop_attn, drop_ffn)
    h1, ln1_res = _in_norm_fwd(p, "ln1", x, config, None)  # (B, T, D)
    a, attn_res = tensor_attention_fwd(p["attn"], h1, config, segments, sequence, ring, k_probs)
    a, ln1_post_res, drop_attn = _branch_fwd(p, "ln1_post", a, config, k_attn, None, "attn", h1, p["attn"])
    x1 = x + a
    h2, ln2_res = _in_norm_fwd(p, "ln2", x1, config, None)
    f, ffn_res = tensor_feed_forward_fwd(p["ffn"], h2, config, sequence)
    f = f[0] if config.n_experts else f  # the MoE layer's statistics stay on ffn_res
    f, ln2_post_res, drop_ffn = _branch_fwd(p, "ln2_post", f, config, k_ffn, None, "ffn", h2, p["ffn"])
    y = x1 + f
    return y, PreBlockRes(ln1_res, attn_res, ln2_res, ffn_res, drop_attn, drop_ffn, ln1_post_res, ln2_post_res)


def tensor_block_bwd(res, dy):
    """dy (B, T, D) -> (dp with one layer's keys, dx (B, T, D)). With n_experts dy is (dy, this
    device's part of the MoE statistics' cotangents), which join the MoE residual."""
    if isinstance(dy, tuple):
        dy, dstats = dy
        res = res._replace(ffn=res.ffn._replace(ffn=res.ffn.ffn._replace(dstats=dstats)))
    if isinstance(res, PostBlockRes):
        # y = ln2(x1 + ffn(x1)); x1 = ln1(x + attn(x))
        d_ln2, d_ffn, dx1 = _post_sublayer_bwd(res.ln2, "ln2", res.drop_ffn, res.ffn, tensor_feed_forward_bwd,
                                               "ffn", dy, None)
        d_ln1, d_attn, dx = _post_sublayer_bwd(res.ln1, "ln1", res.drop_attn, res.attn, tensor_attention_bwd,
                                               "attn", dx1, None)
        grads = {"ln1": d_ln1, "attn": d_attn, "ln2": d_ln2, "ffn": d_ffn}
    else:
        grads = {}
        dx1 = _sublayer_bwd(res, "ffn", tensor_feed_forward_bwd, "ln2", dy, grads, None)  # y = x1 + ffn(ln2(x1))
        dx = _sublayer_bwd(res, "attn", tensor_attention_bwd, "ln1", dx1, grads, None)  # x1 = x + attn(ln1(x))
    # the norms ran on device i's tokens: their gradients are its tokens' part
    return {n: token_sum(g, res.attn.sequence) if n in NORMS else g for n, g in grads.items()}, dx


# ----------------------------------------------------------------------------
# the stacked blocks on a mesh


def split_arrays(tree):
    """tree -> (its array leaves, (treedef, the other leaves with None where the arrays were)):
    what a scan and a shard_map carry, and what stays static (the configs, the flags)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [a for a in leaves if isinstance(a, jax.Array)]
    return arrays, (treedef, [None if isinstance(a, jax.Array) else a for a in leaves])


def join_arrays(arrays, rest):
    """Undoes split_arrays."""
    treedef, leaves = rest
    it = iter(arrays)
    return jax.tree_util.tree_unflatten(treedef, [next(it) if a is None else a for a in leaves])


class TensorBlocksRes(NamedTuple):
    arrays: list  # the per-layer residuals' arrays, (devices, L, ...) each (remat "block", mixed kinds: the input)
    rest: tuple | None  # static: split_arrays' treedef and non-array leaves of one layer's residual
    specs: object  # static: the blocks' PartitionSpec tree
    mesh: object  # static: the mesh
    stream: PartitionSpec = PartitionSpec()  # static: the residual stream's spec (stream_spec)
    blocks: dict | None = None  # remat "block" or mixed kinds: the stacked params, to run each block's forward again
    segments: jax.Array | None = None  # remat "block" or mixed kinds: the document ids (B, T) the blocks read
    config: ModelConfig | None = None  # static; remat "block" or mixed kinds only
    sequence: bool = False  # static; remat "block" or mixed kinds only: the blocks ran sequence parallel
    key: jax.Array | None = None  # remat "block" or mixed kinds only: the dropout key the blocks drew from


def tensor_blocks_fwd(blocks, x, config: ModelConfig, mesh, segments=None, sequence: bool = False, key=None):
    """tensor_blocks with residuals: the stacked blocks (L, ...), x (B, T, D) -> (y, TensorBlocksRes)
    (on a mesh with a context axis: x and segments in its zig-zag order, T split over it). With
    remat "block" a layer keeps only its input (device i's view of it); the backward runs its
    forward again. ``key``: dropout's key (None: none): each device draws its piece of layer l's
    masks (the residuals keep the keys; the backward draws the masks again)."""
    check_tensor_blocks(config, mesh, x, sequence)
    t, ring = tensor_size(mesh), ring_on(mesh)
    specs, rows, every = block_specs(blocks, config, t), segments_spec(mesh), PartitionSpec(mesh.axis_names)
    stream = stream_spec(mesh, sequence)
    remat, static = keeps_inputs(config), {}  # remat "block" or layers of several kinds

    def fwd(blocks, x, segments, key):
        def step(carry, xs):
            x, s = carry
            p, l = xs
            lkey = layer_device_key(key, l, x, config, mesh, sequence)
            p = site_piece_keys(p, x, mesh)  # LoRA dropout's keys: device i's piece

            def run(c):  # layer l's config (layer_kinds.per_layer)
                y, res = tensor_block_fwd(p, x, c, s, sequence, ring, lkey)
                stats = res.ffn.ffn.stats if config.n_experts else None  # the MoE layer's, over device i's tokens
                if remat:
                    return y, [x], stats  # the block's input alone (its residuals are dropped)
                arrays, static["rest"] = split_arrays(res)
                return y, arrays, stats

            y, arrays, stats = per_layer(config, l, run)
            return (y, s), (arrays, stats)

        (y, _), (arrays, stats) = jax.lax.scan(step, (x, segments), (blocks, jnp.arange(config.n_layers)))
        stats = None if stats is None else moe_global_stats(stats, mesh)  # over the whole batch
        return y, [a[None] for a in arrays], stats  # device s's residuals: row s

    y, arrays, stats = jax.shard_map(fwd, mesh=mesh, in_specs=(specs, stream, rows, PartitionSpec()),
                                     out_specs=(stream, every, PartitionSpec()), check_vma=False)(
        blocks, x, segments, key)
    y = (y, stats) if config.n_experts else y
    if remat:
        return y, TensorBlocksRes(arrays, None, specs, mesh, stream, blocks, segments, config, sequence, key)
    return y, TensorBlocksRes(arrays, static["rest"], specs, mesh, stream)


def tensor_blocks_bwd(res: TensorBlocksRes, dy):
    """dy (B, T, D) -> (the blocks' gradients (L, ...), laid out as the blocks, dx (B, T, D)). With
    n_experts dy is (dy, the cotangents of the MoE statistics stacked over L): their pmean over the
    token axes and tensor (moe_global_stats) hands each device 1/n of them."""
    mesh, stream, every = res.mesh, res.stream, PartitionSpec(res.mesh.axis_names)
    batch_axes = tuple(a for a in mesh.axis_names if a != TENSOR)  # the rows' axes, and a context axis' tokens
    remat = res.blocks is not None
    dy, dstats = dy if isinstance(dy, tuple) else (dy, None)
    if dstats is not None:  # stats = pmean(stats_i) over the token axes and tensor: dstats_i = dstats / n
        n = int(np.prod([dict(mesh.shape)[a] for a in (*token_axes(mesh)[0], TENSOR)]))
        dstats = jax.tree_util.tree_map(lambda d: d / n, dstats)

    def bwd(arrays, dy, blocks, segments, key, dstats):
        def step(dy, xs):
            arrays, p, l, dstats_l = xs
            dy = dy if dstats_l is None else (dy, dstats_l)
            if not remat:
                dp, dx = tensor_block_bwd(join_arrays(arrays, res.rest), dy)
                return dx, dp
            lkey = layer_device_key(key, l, arrays[0], res.config, mesh, res.sequence)
            p = site_piece_keys(p, arrays[0], mesh)

            def run(c):  # the block's forward again from its input (the same masks), for its residuals
                layer = tensor_block_fwd(p, arrays[0], c, segments, res.sequence, ring_on(mesh), lkey)[1]
                dp, dx = tensor_block_bwd(layer, dy)
                return dx, dp
            return per_layer(res.config, l, run)  # layer l's config (layer_kinds.per_layer)

        n_layers = jax.tree_util.tree_leaves(arrays)[0].shape[1]
        dx, grads = jax.lax.scan(step, dy, ([a[0] for a in arrays], blocks, jnp.arange(n_layers), dstats), reverse=True)
        if batch_axes:  # the batch is split over these axes: each device's gradients are its rows'
            grads = jax.tree_util.tree_map(lambda g: jax.lax.psum(g, batch_axes), grads)
        return grads, dx

    if not remat:  # the blocks' params are not read again: a scan over nothing but the residuals
        return jax.shard_map(lambda arrays, dy, dstats: bwd(arrays, dy, None, None, None, dstats), mesh=mesh,
                             in_specs=(every, stream, PartitionSpec()), out_specs=(res.specs, stream),
                             check_vma=False)(res.arrays, dy, dstats)
    return jax.shard_map(bwd, mesh=mesh, in_specs=(every, stream, res.specs, segments_spec(mesh), PartitionSpec(),
                                                   PartitionSpec()),
                         out_specs=(res.specs, stream), check_vma=False)(res.arrays, dy, res.blocks, res.segments,
                                                                         res.key, dstats)
