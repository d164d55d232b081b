"""Context parallelism for the whole model: the sequence split over the mesh's ``context`` axis
(c devices), each device holding T/c tokens of every activation from the embedding to the loss,
and attention the one layer that reads other devices' tokens: ring attention (ring.py).

    ids = to_zigzag(inputs)               (B, T) int, natural order -> zig-zag order (ring.py's
                                          layout: device i's slots hold pieces i and 2c-1-i of
                                          n = T/2c tokens); targets, mask and document ids alike
    x = embed(ids, positions=ring_positions(T, c))
                                          each token's row and its GLOBAL position's (B, T, D)
    x_i = x[:, device i's T/c slots]      shard_map: T over context, B over every other axis
    x_i = block_l(x_i), l = 0 .. L-1      the model's compose_block (block.py), its attention's core
                                          ring attention over the context axis, the rotary
                                          positions each token's global one (chunk_positions)
    loss = mean over tokens of CE(head(norm(x)), targets)
                                          token by token: each device's T/c tokens (a mean does
                                          not depend on the tokens' order)

Everything but attention acts token by token: the embedding, the norms, the feed-forward, the
residual adds, the q/k/v and output projections, QK-norm, the head and the loss; each device runs
them on its own T/c tokens unchanged (the model's own layers, no math written twice). So the
tokens are reordered once, as integers, before the embedding (``ring_ordered``), and the loss
never puts them back: no (B, T, D) activation and no (B, T, V) logits on any device. ``forward``
(the logits in natural order) reorders its logits back (``from_zigzag``).
Dropout draws one device's masks, each device its piece (dropout.PieceKey): a block's masks over
its rows and its tokens' global positions (``context_layer_key``), the probabilities' over each
ring visit's query and key positions (ring.visit_dropout), the embedding's over each slot's
natural position (``embed_context_key``), so a step on the mesh equals one device's with the same
key (the full core's masks, or the blockwise core's, one per block pair).
Packed documents' ids (B, T) are reordered and split like the tokens; the ring masks other
documents' keys. The params are replicated: each device's gradient is its tokens' and rows'
part, summed over the context axis and the batch axes (jax.grad: shard_map's transpose of a
replicated input and the partitioner's sums outside it; the manual backward,
manual_grads/parallel/context.py, with a psum of its own for the blocks).

``context_blocks`` is what the model's forward runs under a mesh with a context axis larger
than 1 (``context_mesh``; jaxformer/model/transformer.py, manual_grads/model.py). What the ring
does not run is refused in one line naming the axis, its size and what it refuses or must
divide (``check_context_model``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxformer.model.attention import Core, attention
from jaxformer.model.block import BlockLayers, compose_block, model_feed_forward
from jaxformer.model.config import ModelConfig
from jaxformer.model.cores import AttentionSpec
from jaxformer.model.layer_kinds import per_layer
from jaxformer.model.layer_norm import layer_norm
from jaxformer.model.dropout import Piece, PieceKey, embed_key, layer_key
from jaxformer.model.parallel.pieces import device_piece, local_positions, site_piece_keys
from jaxformer.model.parallel.regions import TENSOR, axis_size, token_axes, trace_mesh_with
from jaxformer.model.parallel.ring import CONTEXT, check_context, ring_attention, to_zigzag
from jaxformer.model.parallel.ring_flash import ring_flash_attention
from jaxformer.model.rms_norm import rms_norm


def context_size(mesh) -> int:
    return axis_size(mesh, CONTEXT)


def context_mesh():
    """The trace's mesh when it has a context axis larger than 1 (regions.trace_mesh_with): the
    whole model's blocks then run as ``context_blocks`` (the forward, jaxformer/model/transformer.py)
    and ``context_blocks_fwd`` / ``_bwd`` (manual_grads/model.py); None otherwise."""
    return trace_mesh_with(CONTEXT)


def stream_spec(mesh) -> PartitionSpec:
    """The (B, T, ...) spec of the context-parallel blocks' activations and of the batch's ids: B
    over the batch axes (regions.batch_axes: a context group shares its rows), T over context
    (regions.token_axes)."""
    return token_axes(mesh)[1]


def check_context_model(config: ModelConfig, c: int, seq_len: int, t: int = 1) -> None:
    """A ValueError in one line unless a context axis of size c can run ``config`` on sequences of
    ``seq_len`` tokens (2c must divide it: the zig-zag layout's pieces); ``t``: the mesh's tensor
    axis (the blocks then tensor parallel as well: parallel/tensor.py, without sequence parallelism)."""
    if c <= 1:
        return
    check_context(seq_len, c)
    impl, block, n = config.attention_impl, config.attention_block, seq_len // (2 * c)
    refused = [(t > 1 and config.sequence_parallel, f"sequence_parallel beside a tensor axis (tensor={t}: the "
                                                      "tokens are split over context already)"),
               (impl not in RING_CORES, f"attention_impl {impl!r} (the ring's visits are the full or the "
                                        "blockwise core's math, or the Pallas kernels: use attention_impl "
                                        "'full', 'blockwise' or 'pallas')"),
               (impl == "blockwise" and any(m % min(block, m) for m in (n, 2 * n)),
                f"attention_block {block} with pieces of {n} tokens (the ring's visits fold {n} or {2 * n} keys: "
                f"the block must divide {n}, or be at least {2 * n})")]
    for on, what in refused:
        if on:
            raise ValueError(f"mesh axis context={c}: context parallelism does not run {what} yet; use context=1")


def ring_core(q, k, v, spec, key=None, segments=None, *, blockwise: bool = False):
    """A core (cores.py's signature) inside shard_map over the context axis: q (B, H, T/c, Dh),
    k, v (B, Hkv, T/c, Dh) of this device's tokens -> O (B, H, T/c, Dh), its queries' attention
    over the whole sequence (ring.ring_attention with spec's mask rule, compute dtype and soft
    cap; ``blockwise``: each visit's keys spec.block at a time; ``key``: the probabilities' dropout
    key at spec.dropout)."""
    return ring_attention(q, k, v, segments=segments, key=key, **ring_kwargs(spec, blockwise))


def ring_flash_core(q, k, v, spec, key=None, segments=None):
    """A core (cores.py's signature) inside shard_map over the context axis: ring_core's, every
    visit the Pallas kernels (ring_flash.py; tiles spec.block_q x spec.block_k, spec.window; no
    dropout: ModelConfig refuses it with the kernels)."""
    return ring_flash_attention(q, k, v, segments, ring_flash_spec(spec))


def ring_flash_spec(spec):
    """What ring_flash reads of a core's AttentionSpec: the mask rule, the products' dtype, the tiles."""
    return AttentionSpec(causal=spec.causal, compute_dtype=spec.compute_dtype, window=spec.window,
                         block_q=spec.block_q, block_k=spec.block_k)


def ring_kwargs(spec, blockwise: bool) -> dict:
    """What the ring reads of a core's AttentionSpec (both gradient sources' cores)."""
    return dict(causal=spec.causal, compute_dtype=spec.compute_dtype, softcap=spec.softcap, window=spec.window,
                block=spec.block if blockwise else 0, dropout=spec.dropout)


# The ring's cores by ModelConfig.attention_impl: the full core's visits, the blockwise core's
# (keys attention_block at a time), or the Pallas kernels'. Each reads k, v with their Hkv heads:
# fewer bytes travel.
RING_CORES = {"full": Core(ring_core, True), "blockwise": Core(functools.partial(ring_core, blockwise=True), True),
              "pallas": Core(ring_flash_core, True)}


def ring_core_of(config: ModelConfig) -> Core:
    """The ring's core for config.attention_impl (check_context_model refuses the others)."""
    return RING_CORES[config.attention_impl]


def context_attention(p, x, config: ModelConfig, key=None, segments=None):
    """The model's attention on device i's T/c tokens (under shard_map): x (B, T/c, D) ->
    (y (B, T/c, D), None), a BlockLayers attention: the ring as its core, rotary positions global."""
    return attention(p, x, config, key, ring_core_of(config), segments, positions=local_positions(x.shape[1])), None


CONTEXT_LAYERS = BlockLayers(context_attention, model_feed_forward, layer_norm, rms_norm)


def context_block(p, x, config: ModelConfig, segments=None, key=None):
    """One block on device i (under shard_map): the model's compose_block with CONTEXT_LAYERS,
    x and y device i's (B, T/c, D), ``segments`` its (B, T/c) ids or None, ``key`` the layer's
    dropout key as device i's piece (``context_layer_key``) or None. With n_experts (y, the MoE
    layer's MoeStats over device i's tokens)."""
    y, aux = compose_block(p, x, config, CONTEXT_LAYERS, key, segments)
    return (y, aux[1]) if config.n_experts else y


def context_layer_key(key, l, x, mesh):
    """Inside shard_map: layer l's dropout key (dropout.layer_key) as device i's PieceKey, x its
    (B/n, T/c, D): its rows of the batch and its tokens' global positions (zig-zag), so that each
    of the layer's masks is the piece of one device's it holds (the probabilities' too: the ring
    draws each visit's queries and keys, ring.visit_dropout); None without a key."""
    return None if key is None else PieceKey(layer_key(key, l), device_piece(x, mesh))


def embed_context_key(key, config: ModelConfig, T: int, c: int):
    """The embedding's dropout key (dropout.embed_key) over the whole (B, T, D) array in the context
    axis' zig-zag order: a PieceKey whose tokens are each slot's natural position
    (``ring_positions``), so the mask is one device's, reordered as the tokens are; None without a key."""
    if key is None or not config.dropout:
        return None
    return PieceKey(embed_key(key, config.n_layers), Piece(tokens=(T, ring_positions(T, c))))


def global_stats(stats, mesh):
    """Inside shard_map: the MoE layers' statistics over device i's tokens (means over them:
    the share of tokens routed to each expert, the mean router probability, the mean squared
    log-sum-exp) -> over every device's tokens, as one device computes them over the whole
    batch: every device holds as many tokens, so the whole batch's mean is the mean of theirs
    (a pmean over the axes the tokens split over: regions.token_axes)."""
    return jax.tree_util.tree_map(lambda s: jax.lax.pmean(s, token_axes(mesh)[0]), stats)


def ring_positions(T: int, c: int):
    """(T,) int: the global position of each token in the zig-zag order (device 0's T/c first)."""
    return to_zigzag(jnp.arange(T)[None], c)[0]


def ring_ordered(a, mesh):
    """A (B, T, ...) batch array (inputs, targets, mask, document ids) or None, in natural order
    -> in the context axis' zig-zag order, split as the blocks' stream is (``stream_spec``: B over
    the batch axes, T over context), so that what acts token by token before and after the blocks
    (the embedding, the head, the loss) runs on each device's own T/c tokens."""
    if a is None:
        return None
    a = to_zigzag(a, context_size(mesh))
    return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, stream_spec(mesh)))


def context_blocks(blocks, x, config: ModelConfig, mesh, segments=None, key=None):
    """The stacked blocks (leaves (L, ...)) on ``mesh``: x (B, T, D) -> (B, T, D), both in the
    context axis' zig-zag order (``ring_ordered``), the tokens split over the mesh's context axis,
    the rows over its other axes; ``segments`` (B, T) int document ids in the same order, or None;
    ``key`` dropout's (each device draws its piece of one device's masks: ``context_layer_key``).
    With n_experts (y, the MoE layers' MoeStats stacked over L, over the whole batch: global_stats)."""
    c = context_size(mesh)
    check_context_model(config, c, x.shape[1], dict(mesh.shape).get(TENSOR, 1))
    key = key if config.dropout else None

    def local(blocks, x, segments, key):
        def layer(p, x, l):  # layer l's config: its kind of attention (layer_kinds.per_layer)
            p = site_piece_keys(p, x, mesh)  # LoRA dropout's keys: device i's rows and tokens
            lkey = context_layer_key(key, l, x, mesh)
            return per_layer(config, l, lambda c: context_block(p, x, c, segments, lkey))
        if config.remat == "block":  # JAX's grad keeps each block's input alone and runs it again
            layer = jax.checkpoint(layer)
        layers = (blocks, jnp.arange(config.n_layers))
        if not config.n_experts:
            return jax.lax.scan(lambda x, pl: (layer(pl[0], x, pl[1]), None), x, layers)[0]
        x, stats = jax.lax.scan(lambda x, pl: layer(pl[0], x, pl[1]), x, layers)  # a block's output: (y, its stats)
        return x, global_stats(stats, mesh)

    stream = stream_spec(mesh)  # x (B, T, D) and the ids (B, T) alike
    out_specs = (stream, PartitionSpec()) if config.n_experts else stream
    return jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), stream, stream, PartitionSpec()),
                         out_specs=out_specs)(blocks, x, segments, key)
