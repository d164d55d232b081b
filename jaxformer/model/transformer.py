"""The whole model: features, forward(params, inputs, config) -> logits, and loss_fn.

    x = drop(embed(inputs))            (B, T, D)
    x = block_l(x), l = 0 .. L-1       lax.scan over params["blocks"] and the layer index l
    x = ln_f(x)                        every layout but post (an RMS norm with norm_type "rms")
    logits = x @ head.w + head.b       (B, T, V); tie_embeddings: head.w = tok_embed^T;
                                       no head.b with head_bias False
    logits = c tanh(logits / c)        only with logit_softcap c > 0 (softcap.py)
    loss = cross_entropy(logits)       ()   (loss_chunk > 0: both, chunk by chunk)

This is the one place the sequence is written. Each function takes the layer
functions it composes as ``layers`` (a ``ModelLayers``), the model's by default;
manual_grads.custom_vjp passes its drop-ins, whose gradient is the hand-derived one.

Dropout (config.dropout) runs only when a PRNG ``key`` is given (training); the
keys of each mask are dropout.py's. key None: no dropout.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.block import block, pick_norm, remat_block
from jaxformer.model.chunked_loss import chunked_head_loss
from jaxformer.model.config import ModelConfig
from jaxformer.model.embedding import embed
from jaxformer.model.layer_kinds import per_layer
from jaxformer.model.layer_norm import layer_norm
from jaxformer.model.linear import linear
from jaxformer.model.losses import cross_entropy
from jaxformer.model.moe import ffn_output, moe_aux_loss
from jaxformer.model.dropout import embed_key, layer_key
from jaxformer.model.parallel.context import (context_blocks, context_mesh, context_size, embed_context_key, ring_ordered,
                                              ring_positions)
from jaxformer.model.parallel.ring import from_zigzag
from jaxformer.model.parallel.tensor import tensor_blocks, tensor_mesh, tensor_size
from jaxformer.model.parallel.vocab import vocab_head_loss
from jaxformer.model.params import head_weights, validate_params
from jaxformer.model.precision import upcast
from jaxformer.model.rms_norm import rms_norm
from jaxformer.model.softcap import softcap
from jaxformer.model.validate import check_precision, validate_batch, validate_tokens


TOKEN_KEYS = ("inputs", "targets", "mask", "segments")  # a batch's (B, T) arrays, one entry a token


class ModelLayers(NamedTuple):
    """The layer functions features, forward and loss_fn compose."""

    embed: Callable  # (params, inputs int (B, T), config, key=None) -> x (B, T, D)
    block: Callable  # (p, x (B, T, D), config, key=None, segments=None) -> (B, T, D); p one layer's slice
    # of params["blocks"]; segments (B, T) document ids, given as a keyword only where not None
    remat_block: Callable  # (p, x, config, key, segments=None) block keeping only its inputs (remat "block")
    layer_norm: Callable  # (p, x, eps) -> (B, T, D): the final norm
    linear: Callable  # (x, w, b or None, compute_dtype) -> x @ w + b: the head
    cross_entropy: Callable  # (logits (B, T, V), targets, mask) -> ()
    chunked_head_loss: Callable  # (head {"w", "b"?}, x (B, T, D), targets, mask, chunk, compute_dtype
    # [, softcap: given only where config.logit_softcap is set]) -> ()
    rms_norm: Callable = rms_norm  # (p, x, eps[, offset]) -> (B, T, D): the final norm with norm_type "rms"
    softcap: Callable = softcap  # (x, cap) -> cap * tanh(x / cap): the logits' cap (logit_softcap)


MODEL_LAYERS = ModelLayers(embed, block, remat_block, layer_norm, linear, cross_entropy,
                           chunked_head_loss, rms_norm)


def check_segments(segments, inputs):
    """segments (B, T) integer document ids beside inputs (B, T), or None: returned as they
    are; a ValueError naming the shape or dtype otherwise."""
    if segments is None:
        return None
    if segments.shape != inputs.shape or not jnp.issubdtype(segments.dtype, jnp.integer):
        raise ValueError(f"batch['segments'] must be integer document ids shaped like inputs "
                         f"{tuple(inputs.shape)}; got {segments.dtype} {tuple(segments.shape)}")
    return segments


def features(params, inputs, config: ModelConfig, layers: ModelLayers = MODEL_LAYERS, key=None,
             segments=None):
    """inputs int (B, T) -> the head's input (B, T, D): embeddings, blocks, final norm."""
    return features_and_stats(params, inputs, config, layers, key, segments)[0]


def features_and_stats(params, inputs, config: ModelConfig, layers: ModelLayers = MODEL_LAYERS, key=None,
                       segments=None, *, ring_order: bool = False):
    """(features (B, T, D), the MoE layers' MoeStats stacked over L, or None without experts).
    With remat "block" each scanned block is layers.remat_block (the model's: a
    jax.checkpoint, so JAX's grad keeps only its input and recomputes the rest).
    ``key``: dropout's PRNG key (None: no dropout); ``segments`` (B, T) int: each position's
    document in a packed row, every attention masking the keys of other documents (None: one
    document a row). Positions run on across a row's documents (docs/design.md, "Packed documents").
    Under a mesh with a context axis (model/parallel/context.py) the features come back in natural
    order, or, with ``ring_order``, in the context axis' order the inputs and segments are then in."""
    validate_tokens("inputs", inputs, config)
    seg = {} if check_segments(segments, inputs) is None else {"segments": segments}
    validate_params(params, config)
    context = context_mesh()
    if context is not None:  # the sequence split over the mesh's context axis from the embedding on
        return _context_features(params, inputs, config, layers, segments, context, ring_order, key)
    if not config.dropout:
        key = None
    ekey = None if key is None else embed_key(key, config.n_layers)
    x = upcast(layers.embed(params, inputs, config, ekey))  # (B, T, D), float32 or wider: the residual stream
    layer = layers.remat_block if config.remat == "block" else layers.block

    def step(x, xs):
        p, l = xs
        lkey = None if key is None else layer_key(key, l)
        run = lambda c: ffn_output(layer(p, x, c, **seg) if lkey is None else  # noqa: E731
                                   layer(p, x, c, key=lkey, **seg), c)
        return per_layer(config, l, run)  # layer l's config: its kind of attention (layer_kinds.py)

    mesh = tensor_mesh()
    if mesh is not None:  # the blocks tensor parallel over the mesh's tensor axis (model/parallel/tensor.py)
        if layers is not MODEL_LAYERS:
            raise ValueError(f"mesh axis tensor={tensor_size(mesh)}: tensor parallelism runs the model's own layers "
                             "(and the manual backward), not custom ones; use tensor=1")
        x, stats = ffn_output(tensor_blocks(params["blocks"], x, config, mesh, segments, config.sequence_parallel,
                                            key), config)
    else:
        x, stats = jax.lax.scan(step, x, (params["blocks"], jnp.arange(config.n_layers)))
    if config.norm != "post":
        x = pick_norm(layers, config)(params["ln_f"], x, config.ln_eps)
    return x, stats


def _context_features(params, inputs, config: ModelConfig, layers: ModelLayers, segments, mesh, ring_order: bool,
                      key=None):
    """features on ``mesh``'s context axis: the tokens (and document ids) in its zig-zag order
    from the embedding on (``ring_ordered``: already so with ``ring_order``), each at its global
    position, the blocks ring-attention context parallel; (x (B, T, D) returned in that order with
    ``ring_order`` (the loss reads its targets so), else in natural order; the MoE layers'
    statistics over the whole batch, or None)."""
    c = context_size(mesh)
    if layers is not MODEL_LAYERS:
        raise ValueError(f"mesh axis context={c}: context parallelism runs the model's own layers (and the manual "
                         "backward), not custom ones; use context=1")
    if not ring_order:
        inputs, segments = ring_ordered(inputs, mesh), ring_ordered(segments, mesh)
    T = inputs.shape[1]
    # the embedding's dropout mask is one device's, its tokens reordered as the inputs are (embed_context_key)
    x = upcast(embed(params, inputs, config, embed_context_key(key, config, T, c), ring_positions(T, c)))
    key = key if config.dropout else None
    if tensor_mesh() is not None:  # a tensor axis beside: the blocks tensor parallel too, attention the ring
        x, stats = ffn_output(tensor_blocks(params["blocks"], x, config, mesh, segments, config.sequence_parallel,
                                            key), config)
    else:
        x, stats = ffn_output(context_blocks(params["blocks"], x, config, mesh, segments, key), config)
    if config.norm != "post":
        x = pick_norm(layers, config)(params["ln_f"], x, config.ln_eps)
    return (x if ring_order else from_zigzag(x, c)), stats


def head_params(params, config: ModelConfig) -> dict:
    """The head as a linear layer's params: {"w": (D, V), "b": (V,) if head_bias};
    w is tok_embed^T with tie_embeddings."""
    w, b = head_weights(params, config)
    return {"w": w} if b is None else {"w": w, "b": b}


def forward(params, inputs, config: ModelConfig, layers: ModelLayers = MODEL_LAYERS, key=None,
            segments=None):
    """inputs int (B, T) -> logits (B, T, V), in the dtype of the params (float32 when
    config.compute_dtype puts the matmuls of float32 params in bfloat16); capped to
    c tanh(logits / c) with config.logit_softcap c. ``segments`` (B, T): packed documents' ids."""
    x = features(params, inputs, config, layers, key, segments)  # (B, T, D)
    return head_logits(params, x, config, layers)


def head_logits(params, x, config: ModelConfig, layers: ModelLayers = MODEL_LAYERS):
    """x (B, T, D) -> logits (B, T, V): the head, and the softcap with config.logit_softcap."""
    logits = layers.linear(x, *head_weights(params, config), config.compute_dtype)  # (B, T, V)
    if config.logit_softcap:
        logits = layers.softcap(logits, config.logit_softcap)
    return logits


def loss_fn(params, batch, config: ModelConfig, layers: ModelLayers = MODEL_LAYERS, key=None):
    """Mean next-token cross entropy of ``batch`` = {"inputs", "targets", "mask"?, "segments"?}
    (segments: (B, T) document ids of packed rows, as ``features`` reads them), plus the MoE
    layers' auxiliary loss (moe.moe_aux_loss) with n_experts.
    loss_chunk > 0 runs the head (and the logits' softcap) and the loss chunk by chunk: no
    (B, T, V) logits. ``key``: dropout's PRNG key for this step (None: no dropout)."""
    return loss_and_stats(params, batch, config, layers, key)[0]


def loss_and_stats(params, batch, config: ModelConfig, layers: ModelLayers = MODEL_LAYERS, key=None):
    """(loss_fn's loss, the MoE layers' MoeStats stacked over L, or None without experts)."""
    validate_batch(batch, config)
    check_precision(params, config)
    context = context_mesh()
    if context is not None:  # every token, target, weight and document id in the context axis' order
        batch = {k: ring_ordered(v, context) if k in TOKEN_KEYS else v for k, v in batch.items()}  # (a mean
        # over the tokens is the same in any order)
    x, stats = features_and_stats(params, batch["inputs"], config, layers, key, batch.get("segments"),
                                  ring_order=context is not None)  # (B, T, D)
    mesh = tensor_mesh()
    if mesh is not None:  # the head's vocabulary split over the tensor axis too (model/parallel/vocab.py)
        loss = vocab_head_loss(head_params(params, config), x, batch["targets"], batch.get("mask"), mesh,
                               config.compute_dtype, config.logit_softcap, config.loss_chunk)
    elif config.loss_chunk:
        cap = (config.logit_softcap,) if config.logit_softcap else ()
        loss = layers.chunked_head_loss(head_params(params, config), x, batch["targets"],
                                        batch.get("mask"), config.loss_chunk, config.compute_dtype, *cap)
    else:
        loss = layers.cross_entropy(head_logits(params, x, config, layers), batch["targets"], batch.get("mask"))
    return (loss, None) if stats is None else (loss + moe_aux_loss(stats, config), stats)
