"""Context parallelism for the whole model: the stacked blocks with the sequence split over the
mesh's ``context`` axis (c devices), each device holding T/c tokens of every activation, and
attention the one layer that reads other devices' tokens: ring attention (ring.py).

    x = to_zigzag(x)                      (B, T, D), natural order -> zig-zag (ring.py's layout):
                                          device i's slots hold pieces i and 2c-1-i of n = T/2c tokens
    x_i = x[:, device i's T/c slots]      shard_map: T over context, B over every other axis
    x_i = block_l(x_i), l = 0 .. L-1      the model's compose_block (block.py), its attention's core
                                          ring attention over the context axis, the rotary
                                          positions each token's GLOBAL one (chunk_positions)
    y = from_zigzag(concat_i x_i)         natural order again

Everything else in a block acts token by token: the norms, the feed-forward, the residual
adds, the q/k/v and output projections, QK-norm; each device runs them on its own T/c tokens
unchanged (the model's own layers, no math written twice). Learned (or sinusoidal) position
embeddings are added in the embedding, before the blocks, in natural order: already right.
Packed documents' ids (B, T) are reordered and split like the tokens; the ring masks other
documents' keys. The params are replicated: each device's gradient is its tokens' and rows'
part, summed over the context axis and the batch axes (jax.grad: shard_map's transpose of a
replicated input; the manual backward, manual_grads/parallel/context.py, with a psum of its own).

``context_blocks`` is what the model's forward runs under a mesh with a context axis larger
than 1 (``context_mesh``; jaxformer/model/transformer.py, manual_grads/model.py). What the ring
does not run is refused in one line naming the axis, its size and what it refuses or must
divide (``check_context_model``).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec

from jaxformer.model.attention import Core, attention
from jaxformer.model.block import BlockLayers, compose_block, model_feed_forward
from jaxformer.model.config import ModelConfig
from jaxformer.model.layer_kinds import mixed
from jaxformer.model.layer_norm import layer_norm
from jaxformer.model.parallel.regions import TENSOR, axis_size, batch_axes, trace_mesh_with
from jaxformer.model.parallel.ring import (CONTEXT, check_context, chunk_positions, from_zigzag, ring_attention,
                                           to_zigzag)
from jaxformer.model.rms_norm import rms_norm


def context_size(mesh) -> int:
    return axis_size(mesh, CONTEXT)


def context_mesh():
    """The trace's mesh when it has a context axis larger than 1 (regions.trace_mesh_with): the
    whole model's blocks then run as ``context_blocks`` (the forward, jaxformer/model/transformer.py)
    and ``context_blocks_fwd`` / ``_bwd`` (manual_grads/model.py); None otherwise."""
    return trace_mesh_with(CONTEXT)


def row_axes(mesh) -> tuple[str, ...]:
    """The axes the batch's rows split over in the context-parallel blocks: every mesh axis but
    tensor and context (regions.batch_axes: a context group shares its rows)."""
    return batch_axes(mesh)


def stream_spec(mesh) -> PartitionSpec:
    """The (B, T, ...) spec inside the context-parallel blocks: B over ``row_axes``, T over context."""
    return PartitionSpec(row_axes(mesh) or None, CONTEXT)


def check_context_model(config: ModelConfig, c: int, seq_len: int, t: int = 1) -> None:
    """A ValueError in one line unless a context axis of size c can run ``config`` on sequences of
    ``seq_len`` tokens (2c must divide it: the zig-zag layout's pieces); ``t``: the mesh's tensor
    axis, refused beside it."""
    if c <= 1:
        return
    check_context(seq_len, c)
    impl = config.attention_impl
    refused = [(t > 1, f"a tensor axis beside it (tensor={t}: one of the two splits at a time)"),
               (config.dropout, "dropout (each device would draw its own tokens' masks)"),
               (impl != "full", f"attention_impl {impl!r} (the ring's visits are the full core's math: "
                                "use attention_impl 'full')"),
               (any(config.windowed_layers), "sliding windows (sliding_window, layer_types: the ring masks "
                                             "causally over every key)"),
               (mixed(config), "layers of more than one kind (layer_types, rope_layers: one block for all)"),
               (config.attn_softcap, "attn_softcap (the ring's scores are not capped)"),
               (config.n_experts, "n_experts (the experts split over the expert axis)"),
               (config.remat == "block", "remat 'block' (the context-parallel blocks keep their residuals)")]
    for on, what in refused:
        if on:
            raise ValueError(f"mesh axis context={c}: context parallelism does not run {what} yet; use context=1")


def refuse_adapters(blocks, c: int) -> None:
    """LoRA adapters in the blocks' params (a sublayer's "lora"): refused on a context axis."""
    if c > 1 and any(isinstance(p, dict) and "lora" in p for p in blocks.values()):
        raise ValueError(f"mesh axis context={c}: context parallelism does not run LoRA adapters yet; use context=1")


def local_positions(n_local: int):
    """Inside shard_map over the context axis: (T/c,) int, the global positions of this device's
    n_local tokens (ring.chunk_positions of its axis index, zig-zag)."""
    c = jax.lax.axis_size(CONTEXT)
    return chunk_positions(jax.lax.axis_index(CONTEXT), n_local * c, c)


def ring_core(q, k, v, spec, key=None, segments=None):
    """A core (cores.py's signature) inside shard_map over the context axis: q (B, H, T/c, Dh),
    k, v (B, Hkv, T/c, Dh) of this device's tokens -> O (B, H, T/c, Dh), its queries' attention
    over the whole sequence (ring.ring_attention; spec.causal, no dropout: ``key`` unread)."""
    return ring_attention(q, k, v, causal=spec.causal, segments=segments)


RING_CORE = Core(ring_core, True)  # reads k, v with their Hkv heads: fewer bytes travel


def context_attention(p, x, config: ModelConfig, key=None, segments=None):
    """The model's attention on device i's T/c tokens (under shard_map): x (B, T/c, D) ->
    (y (B, T/c, D), None), a BlockLayers attention: the ring as its core, rotary positions global."""
    return attention(p, x, config, key, RING_CORE, segments, positions=local_positions(x.shape[1])), None


CONTEXT_LAYERS = BlockLayers(context_attention, model_feed_forward, layer_norm, rms_norm)


def context_block(p, x, config: ModelConfig, segments=None):
    """One block on device i (under shard_map): the model's compose_block with CONTEXT_LAYERS,
    x and y device i's (B, T/c, D), ``segments`` its (B, T/c) ids or None."""
    return compose_block(p, x, config, CONTEXT_LAYERS, None, segments)[0]


def zigzag_or_none(a, c: int):
    return None if a is None else to_zigzag(a, c)


def context_blocks(blocks, x, config: ModelConfig, mesh, segments=None):
    """The stacked blocks (leaves (L, ...)) on ``mesh``: x (B, T, D) in natural token order ->
    (B, T, D) in natural order, the tokens split over the mesh's context axis (zig-zag), the
    rows over its other axes; ``segments`` (B, T) int document ids, or None."""
    c = context_size(mesh)
    check_context_model(config, c, x.shape[1], dict(mesh.shape).get(TENSOR, 1))
    refuse_adapters(blocks, c)

    def local(blocks, x, segments):
        return jax.lax.scan(lambda x, p: (context_block(p, x, config, segments), None), x, blocks)[0]

    stream = stream_spec(mesh)  # x (B, T, D) and the ids (B, T) alike
    y = jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), stream, stream), out_specs=stream)(
        blocks, to_zigzag(x, c), zigzag_or_none(segments, c))
    return from_zigzag(y, c)
