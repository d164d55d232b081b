"""The context-parallel blocks' hand-derived backward: the pair of
jaxformer/model/parallel/context.py (its forward's lines are quoted from there).

Forward, the sequence split over the context axis (c devices), the rows over the other axes, x
in the zig-zag order the tokens were put in before the embedding (``ring_ordered``: the
embedding, the head and the loss act token by token, manual_grads/model.py runs them so):
    x_i = block_l(x_i), l = 0 .. L-1        per device, under one shard_map: manual_grads/block.py's
                                            sequence, its attention the model's around ring attention
                                            (manual_grads/attention.py's pieces, ring_attention_fwd as
                                            the core, the rotary tables at each token's global position)
Backward, bottom to top:
    the blocks:              per device, a reverse scan of the blocks' backward on its T/c tokens:
                             the norms, feed-forward, projections and residual adds as one device's
                             (token by token), the core's ring backward (dK, dV travel with
                             their chunk), the rotary backward with the forward's tables (each token
                             turned back by its own global angle)
    blocks replicated:       dp = psum(dp_i) over the context axis and the batch axes: each device's
                             gradient is its own tokens' and rows' part
The embedding, the final norm, the head and the loss act token by token; ``context_value_and_grad``
(what manual_grads.value_and_grad runs on a context axis) runs their backwards on each device's
tokens too (``context_top_grads``, ``context_embed_bwd``), so that nothing reshapes a split
(B, T, ...) array into rows XLA would gather first:
    loss = psum(loss_i * n_i / n)           device i's mean over its n_i weighted tokens, n = psum(n_i):
                                            dloss_i = dloss * n_i / n, then head_loss_bwd on its tokens
    ln_f, head, embedding replicated        dp = psum(dp_i), as the blocks'
No activation is gathered: the only collectives are the ring's ppermutes and the one psum of
each gradient leaf.

The manual shard_maps run with check_vma=False: the transposes are the ones written here (the
psum of each replicated leaf's gradient, the ring's hops), proven equal to one device and to
automatic differentiation of the model's forward in tests/test_context_parallel.py (that
forward keeps JAX's varying/invariant types, so that its own transposes are the same sums).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxformer.model.config import ModelConfig
from jaxformer.model.layer_kinds import per_layer
from jaxformer.model.moe import ffn_output, moe_aux_loss
from jaxformer.model.parallel.context import (CONTEXT, check_context_model, context_layer_key, context_size,
                                              embed_context_key, global_stats,
                                              local_positions, ring_core_of, ring_ordered,
                                              ring_positions, stream_spec)
from jaxformer.model.precision import upcast
from jaxformer.model.transformer import TOKEN_KEYS, head_params
from jaxformer.model.parallel.pieces import site_piece_keys
from jaxformer.model.parallel.regions import TENSOR, axis_size, token_axes
from jaxformer.model.parallel.vocab import head_specs, padded
from manual_grads.attention import attention_bwd, attention_fwd
from manual_grads.dropout import dropout_bwd
from manual_grads.embedding import embed_bwd, embed_fwd, embed_params
from manual_grads.head import head_loss_bwd, head_loss_fwd
from manual_grads.block import (PostBlockRes, PreBlockRes, _branch_fwd, _branch_keys, _in_norm_fwd, _post_sublayer_bwd,
                                _post_sublayer_fwd, _sublayer_bwd, with_dstats)
from manual_grads.moe import moe_aux_loss_bwd
from manual_grads.moe_parallel import ffn_bwd, ffn_fwd
from manual_grads.norms import norm_bwd, norm_fwd
from manual_grads.parallel.ring import ring_core_bwd, ring_manual_of
from manual_grads.parallel.tensor import join_arrays, split_arrays, tensor_blocks_bwd, tensor_blocks_fwd
from manual_grads.parallel.vocab import vocab_head_loss_grads_local
from manual_grads.remat import keeps_inputs


def context_attention_fwd(p, x, config: ModelConfig, segments=None, key=None):
    """context_attention with residuals: x (B, T/c, D), device i's tokens -> (y, AttentionRes);
    ``key``: the probabilities' dropout key (the ring draws each visit's piece of its mask)."""
    # attention(p, x, config, key, ring_core_of(config), segments, positions=local_positions(x.shape[1]))
    return attention_fwd(p, x, config, key, segments, local_positions(x.shape[1]), ring_core_of(config),
                         ring_manual_of(config))


def context_attention_bwd(res, dy, narrow_ok: bool = False):
    """dy (B, T/c, D) -> (dp with p's keys: device i's tokens' part, dx (B, T/c, D));
    ``narrow_ok`` as attention_bwd's."""
    return attention_bwd(res, dy, ring_core_bwd, narrow_ok)


def context_block_fwd(p, x, config: ModelConfig, segments=None, key=None):
    """One block on device i: manual_grads/block.py's sequence with the ring's attention
    (no tap: refused), x and y device i's (B, T/c, D), ``key`` the layer's dropout key as device
    i's piece (parallel.context.context_layer_key) or None; with n_experts y is (y, the MoE
    layer's MoeStats over device i's tokens)."""
    k_probs, k_attn, k_ffn = _branch_keys(config, key)
    if config.norm == "post":  # x1 = ln1(x + drop(attn(x))); y = ln2(x1 + drop(ffn(x1)))
        a, attn_res = context_attention_fwd(p["attn"], x, config, segments, k_probs)
        x1, ln1_res, drop_attn = _post_sublayer_fwd(p, "attn", "ln1", x, a, config, k_attn, None)
        f, ffn_res = ffn_fwd(p["ffn"], x1, config)
        f = f[0] if config.n_experts else f  # the MoE layer's statistics stay on ffn_res
        y, ln2_res, drop_ffn = _post_sublayer_fwd(p, "ffn", "ln2", x1, f, config, k_ffn, None)
        res = PostBlockRes(attn_res, ln1_res, ffn_res, ln2_res, drop_attn, drop_ffn)
    else:
        h1, ln1_res = _in_norm_fwd(p, "ln1", x, config, None)  # (B, T/c, D)
        a, attn_res = context_attention_fwd(p["attn"], h1, config, segments, k_probs)
        a, ln1_post_res, drop_attn = _branch_fwd(p, "ln1_post", a, config, k_attn, None, "attn", h1, p["attn"])
        x1 = x + a
        h2, ln2_res = _in_norm_fwd(p, "ln2", x1, config, None)
        f, ffn_res = ffn_fwd(p["ffn"], h2, config)
        f = f[0] if config.n_experts else f
        f, ln2_post_res, drop_ffn = _branch_fwd(p, "ln2_post", f, config, k_ffn, None, "ffn", h2, p["ffn"])
        y = x1 + f
        res = PreBlockRes(ln1_res, attn_res, ln2_res, ffn_res, drop_attn, drop_ffn, ln1_post_res, ln2_post_res)
    return ((y, ffn_res.stats) if config.n_experts else y), res


def context_block_bwd(res, dy):
    """dy (B, T/c, D) -> (dp with one layer's keys, device i's tokens' part; dx (B, T/c, D)).
    With n_experts dy is (dy, dstats): the cotangents of the layer's statistics over device i's
    tokens join the MoE residual (manual_grads/block.py's block_bwd)."""
    res, dy = with_dstats(res, dy)
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
    arrays: list  # the per-layer residuals' arrays, (devices, L, ...) each (remat "block", mixed kinds: the input)
    rest: tuple | None  # static: split_arrays' treedef and non-array leaves of one layer's residual
    mesh: object  # static: the mesh
    blocks: dict | None = None  # remat "block" or mixed kinds: the stacked params, to run each block's forward again
    segments: jax.Array | None = None  # remat "block" or mixed kinds: the document ids (B, T) the blocks read
    config: ModelConfig | None = None  # static; remat "block" or mixed kinds only
    key: jax.Array | None = None  # remat "block" or mixed kinds only: the dropout key the blocks drew from


def context_blocks_fwd(blocks, x, config: ModelConfig, mesh, segments=None, key=None):
    """context_blocks with residuals: the stacked blocks (L, ...), x (B, T, D) and segments
    (B, T) or None in the context axis' zig-zag order -> (y (B, T, D) in that order, ContextBlocksRes).
    With remat "block" a layer keeps only its input; the backward runs its forward again. ``key``:
    dropout's (None: none): each device draws its piece of layer l's masks (the residuals keep the
    keys; the backward draws the masks again)."""
    c = context_size(mesh)
    check_context_model(config, c, x.shape[1], dict(mesh.shape).get(TENSOR, 1))
    stream, every = stream_spec(mesh), PartitionSpec(mesh.axis_names)
    remat, static = keeps_inputs(config), {}  # remat "block" or layers of several kinds
    key = key if config.dropout else None

    def step(x, p, l, segments, key):
        p = site_piece_keys(p, x, mesh)  # LoRA dropout's keys: device i's rows and tokens
        lkey = context_layer_key(key, l, x, mesh)  # the layer's masks: device i's rows and tokens

        def run(c):  # layer l's config (layer_kinds.per_layer)
            y, res = context_block_fwd(p, x, c, segments, lkey)
            y, stats = ffn_output(y, config)  # with n_experts: the layer's statistics over device i's tokens
            if remat:
                return y, ([x], stats)  # the block's input alone (its residuals are dropped)
            arrays, static["rest"] = split_arrays(res)
            return y, (arrays, stats)
        return per_layer(config, l, run)

    def fwd(blocks, x, segments, key):
        y, (arrays, stats) = jax.lax.scan(lambda x, pl: step(x, *pl, segments, key), x,
                                          (blocks, jnp.arange(config.n_layers)))
        # device s's residuals: row s; the statistics over every device's tokens (global_stats)
        return y, [a[None] for a in arrays], None if stats is None else global_stats(stats, mesh)

    # the blocks on each device's T/c tokens
    y, arrays, stats = jax.shard_map(fwd, mesh=mesh, in_specs=(PartitionSpec(), stream, stream, PartitionSpec()),
                                     out_specs=(stream, every, PartitionSpec()), check_vma=False)(blocks, x, segments,
                                                                                                  key)
    y = (y, stats) if config.n_experts else y
    if remat:
        return y, ContextBlocksRes(arrays, None, mesh, blocks, segments, config, key)
    return y, ContextBlocksRes(arrays, static["rest"], mesh)


def context_blocks_bwd(res: ContextBlocksRes, dy):
    """dy (B, T, D) -> (the blocks' gradients (L, ...), dx (B, T, D)), both in the zig-zag order.
    With n_experts dy is (dy, dstats): the cotangents of the MoE layers' whole-batch statistics."""
    mesh, remat = res.mesh, res.blocks is not None
    stream, every = stream_spec(mesh), PartitionSpec(mesh.axis_names)
    summed = summed_axes(mesh)
    dy, dstats = dy if isinstance(dy, tuple) else (dy, None)
    # stats = global_stats(each device's): a pmean over the devices' tokens, whose transpose
    # hands each device's statistics 1 / n of the cotangent (n devices hold the batch's tokens)
    n = math.prod(dict(mesh.shape)[a] for a in summed)
    dstats = None if dstats is None else jax.tree_util.tree_map(lambda d: d / n, dstats)

    def bwd(arrays, dy, blocks, segments, dstats, key):
        def step(dy, xs):
            arrays, p, ds, l = xs
            dy = dy if ds is None else (dy, ds)
            if not remat:
                dp, dx = context_block_bwd(join_arrays(arrays, res.rest), dy)
                return dx, dp

            p = site_piece_keys(p, arrays[0], mesh)
            lkey = context_layer_key(key, l, arrays[0], mesh)

            def run(c):  # the block's forward again from its input (the same masks), for its residuals
                dp, dx = context_block_bwd(context_block_fwd(p, arrays[0], c, segments, lkey)[1], dy)
                return dx, dp
            return per_layer(res.config, l, run)  # layer l's config (layer_kinds.per_layer)

        n_layers = jax.tree_util.tree_leaves(arrays)[0].shape[1]
        dx, grads = jax.lax.scan(step, dy, ([a[0] for a in arrays], blocks, dstats, jnp.arange(n_layers)),
                                 reverse=True)
        # in_specs=(PartitionSpec(), ...): the blocks replicated, each device's use of them its
        # tokens' and rows' part of their gradient: the whole is the sum over every such device
        grads = psum_tree(grads, summed)
        return grads, dx

    if not remat:  # the blocks' params are not read again: a scan over nothing but the residuals
        return jax.shard_map(lambda arrays, dy, dstats: bwd(arrays, dy, None, None, dstats, None), mesh=mesh,
                             in_specs=(every, stream, PartitionSpec()), out_specs=(PartitionSpec(), stream),
                             check_vma=False)(res.arrays, dy, dstats)
    return jax.shard_map(bwd, mesh=mesh, in_specs=(every, stream, PartitionSpec(), stream, PartitionSpec(),
                                                   PartitionSpec()),
                         out_specs=(PartitionSpec(), stream), check_vma=False)(res.arrays, dy, res.blocks,
                                                                               res.segments, dstats, res.key)


# ----------------------------------------------------------------------------
# the embedding, the head and the loss on each device's tokens


def summed_axes(mesh) -> tuple[str, ...]:
    """The axes a replicated param's gradient is summed over: every device's tokens and rows
    (regions.token_axes)."""
    return token_axes(mesh)[0]


def context_top_grads(top, x, targets, mask, config: ModelConfig, mesh):
    """The final norm, the head and the mean cross entropy on each device's tokens (x (B, T, D),
    targets and mask (B, T) in the context axis' order), forward and backward at once: top =
    {"ln_f"? (not with norm "post"), "head"} -> (loss, dtop laid out as top, dx (B, T, D)).
    With a tensor axis too the head's vocabulary is split over it (manual_grads/parallel/vocab.py)."""
    stream, summed, t = stream_spec(mesh), summed_axes(mesh), axis_size(mesh, TENSOR)
    V = top["head"]["w"].shape[-1]
    specs = {n: PartitionSpec() for n in top}
    if t > 1:  # the head's columns split over the tensor axis, padded to a multiple of t
        top = {**top, "head": padded(top["head"], t)}
        specs["head"] = head_specs(top["head"])

    def local(top, x, targets, mask):
        h, ln_f_res = norm_fwd(top["ln_f"], x, config) if "ln_f" in top else (x, None)  # x = ln_f(x)
        dtop = {}
        if t > 1:  # the vocab-parallel head and loss, summed over the rows and tokens (``summed``) inside
            loss, dtop["head"], dx = vocab_head_loss_grads_local(
                top["head"], h, targets, mask, summed, vocab_size=V, compute_dtype=config.compute_dtype,
                cap=config.logit_softcap, chunk=config.loss_chunk)
        else:
            n_i = targets.size if mask is None else jnp.sum(mask.astype(x.dtype))  # device i's weight
            n = jax.lax.psum(jnp.asarray(n_i, x.dtype), summed)
            share = n_i / jnp.where(n > 0, n, 1)  # loss = psum(loss_i * n_i / n): the mean over every token
            loss_i, res = head_loss_fwd(top["head"], h, targets, mask, config)  # device i's mean over its tokens
            d_head, dx = head_loss_bwd(res, share.astype(loss_i.dtype))  # dloss_i = n_i / n
            loss, dtop["head"] = jax.lax.psum(loss_i * share, summed), psum_tree(d_head, summed)
        if ln_f_res is not None:
            d_ln_f, dx = norm_bwd(ln_f_res, dx)  # x = ln_f(x)
            dtop["ln_f"] = psum_tree(d_ln_f, summed)
        return loss, dtop, dx

    in_specs = (specs, stream, stream, None if mask is None else stream)
    loss, dtop, dx = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(PartitionSpec(), specs, stream),
                                   check_vma=False)(top, x, targets, mask)
    dtop["head"] = {n: g[..., :V] for n, g in dtop["head"].items()}  # z = where(id < V, ...): the padding dropped
    return loss, dtop, dx


def psum_tree(tree, axes):
    return jax.tree_util.tree_map(lambda g: jax.lax.psum(g, axes), tree)


def context_embed_bwd(emb, inputs, at, dx, config: ModelConfig, mesh):
    """embed_bwd on each device's tokens (inputs (B, T), their positions ``at`` (T,) and dx (B, T, D)
    in the context axis' order), summed over the devices: the embedding's gradients, laid out as emb."""
    stream = stream_spec(mesh)

    def local(emb, inputs, at, dx):
        _, res = embed_fwd(emb, inputs, config, None, at)  # the residuals: the ids and the tables
        d_embed, _ = embed_bwd(res, dx)  # x = tok_embed[inputs] * s + positions[at]
        return psum_tree(d_embed, summed_axes(mesh))

    return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), stream, PartitionSpec(CONTEXT), stream),
                         out_specs=PartitionSpec(), check_vma=False)(emb, inputs, at, dx)


# ----------------------------------------------------------------------------
# the whole composition


def context_value_and_grad(params, batch, config: ModelConfig, mesh, key=None):
    """manual_grads.value_and_grad's (loss, grads) on a mesh with a context axis (``key``:
    dropout's, each device drawing its piece of one device's masks), the model's lines in order
    (jaxformer/model/transformer.py's features_and_stats on the context axis, loss_and_stats):
        ids, targets, mask, segments = ring_ordered(...)     the tokens in the context axis' order
        x = drop(tok_embed[ids] * s + positions[at])          at = ring_positions(T, c); the mask
                                                              one device's, reordered (embed_context_key)
        x = context_blocks(blocks, x)                         the ring (tensor_blocks with a tensor axis)
        loss = CE(head(ln_f(x)), targets)                     each device's tokens
    and back, bottom to top."""
    inputs, targets, mask, segments = (ring_ordered(batch.get(k), mesh) for k in TOKEN_KEYS)
    at = ring_positions(inputs.shape[1], context_size(mesh))  # each token's global position
    emb = embed_params(params)
    top = {"head": head_params(params, config)}  # {"w": head.w or tok_embed^T, "b"?}
    if config.norm != "post":
        top["ln_f"] = params["ln_f"]
    # forward
    T, c = inputs.shape[1], context_size(mesh)
    key = key if config.dropout else None
    # (B, T, D); a tensor axis: the table's rows split; the dropout mask one device's, reordered as the tokens
    x, embed_res = embed_fwd(emb, inputs, config, embed_context_key(key, config, T, c), at)
    x = upcast(x)
    tensor = axis_size(mesh, TENSOR) > 1  # a tensor axis beside: the blocks tensor parallel too (parallel/tensor.py)
    if tensor:
        x, blocks_res = tensor_blocks_fwd(params["blocks"], x, config, mesh, segments, config.sequence_parallel, key)
    else:
        x, blocks_res = context_blocks_fwd(params["blocks"], x, config, mesh, segments, key)
    x, stats = ffn_output(x, config)  # with n_experts: the MoE layers' statistics over the whole batch
    # the final norm, the head and the loss, forward and backward; then the rest, in reverse
    loss, grads, dx = context_top_grads(top, x, targets, mask, config, mesh)
    if stats is not None:  # loss = cross entropy + moe_aux_loss(stats)
        loss = loss + moe_aux_loss(stats, config)
        dx = (dx, moe_aux_loss_bwd(stats, config))
    grads["blocks"], dx = (tensor_blocks_bwd if tensor else context_blocks_bwd)(blocks_res, dx)  # x = blocks(x)
    # x = drop(tok_embed[ids] * s + positions[at]): with a tensor axis embed_bwd's vocab-parallel scatter
    # into each device's V/t rows (its own shard_map); else each device's tokens into the whole table
    if tensor:
        grads.update(embed_bwd(embed_res, dx)[0])
    else:  # x = drop(...): the whole array's mask, then each device's tokens' rows
        grads.update(context_embed_bwd(emb, inputs, at, dropout_bwd(embed_res.drop, dx), config, mesh))
    d_head = grads.pop("head")
    if config.tie_embeddings:  # logits = x @ tok_embed^T (+ b): the two gradients of tok_embed add
        grads["tok_embed"] = grads["tok_embed"] + d_head.pop("w").T.astype(grads["tok_embed"].dtype)
    if d_head:
        grads["head"] = d_head
    return loss, grads
