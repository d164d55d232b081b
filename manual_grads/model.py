"""The whole model's loss and its gradient, by hand: value_and_grad(params, batch, config).

Forward, keeping each layer's residuals:
    x = drop(embed(inputs))           (B, T, D)
    x = block_l(x), l = 0 .. L-1      lax.scan; the residuals come out stacked on a leading L axis
                                      (remat "block": only each block's input, manual_grads/remat.py)
    x = ln_f(x)                       every layout but post (layer norm, or RMS norm with norm_type "rms")
    logits = x @ head.w + head.b      (B, T, V); tie_embeddings: head.w = tok_embed^T, and the
                                      head's dw^T adds into tok_embed's gradient; no b without head_bias
    logits = c tanh(logits / c)       with logit_softcap c only (the tap's "head" sees it capped)
    loss = cross_entropy(logits)      ()   (loss_chunk > 0: both, chunk by chunk, chunked_loss.py)
Backward: the same list, bottom to top; the blocks run a reverse scan over the
stacked residuals, whose outputs already have params["blocks"]' stacked layout.
Attention is full or blockwise (manual_grads/blockwise.py), as config.attention_impl says.

This is the one manual composition of the whole model. An optional ``tap`` (tap.py)
sees every stage, forward and backward, with the names "embed", "blocks[l].ln1", ...,
"ln_f", "head", "loss" (or one "head + loss" with loss_chunk > 0); the diagnosis of a
non-finite value (jaxformer/training/diagnose.py) is built on it.

Dropout (config.dropout) runs only with a PRNG ``key``, with the masks of the model's
forward (jaxformer/model/dropout.py); what is kept is each mask's key, never a mask:
the backward redraws every mask from its key (per layer: fold_in of the layer index).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxformer.model.config import ModelConfig
from jaxformer.model.dropout import embed_key
from jaxformer.model.moe import ffn_output, moe_aux_loss
from jaxformer.model.transformer import check_segments, head_params
from jaxformer.model.parallel.context import context_mesh, context_size
from jaxformer.model.parallel.tensor import tensor_mesh, tensor_size
from jaxformer.model.params import validate_params
from jaxformer.model.precision import upcast
from jaxformer.model.validate import check_precision, validate_batch
from manual_grads.block import top_feeds
from manual_grads.embedding import embed_bwd, embed_fwd, embed_params
from manual_grads.norms import norm_bwd, norm_fwd
from manual_grads.head import head_loss_bwd, head_loss_fwd
from manual_grads.linear import wide
from manual_grads.moe import moe_aux_loss_bwd
from manual_grads.parallel.context import context_value_and_grad
from manual_grads.parallel.tensor import tensor_blocks_bwd, tensor_blocks_fwd
from manual_grads.parallel.vocab import vocab_head_loss_grads
from manual_grads import remat
from manual_grads.remat import blocks_bwd, blocks_fwd, python_loop
from manual_grads.tap import tap_backward, tap_forward

def value_and_grad(params, batch, config: ModelConfig, key=None, tap=None, with_stats: bool = False):
    """(loss, grads) for batch = {"inputs", "targets", "mask"?, "segments"?}; grads has the tree
    structure and dtype of params. jit it with ``static_argnums=2`` (and no tap).
    ``key``: dropout's PRNG key for this step (None: no dropout), as in jaxformer.loss_fn.

    With config.compute_dtype (bfloat16) the products of forward and backward run in it
    with float32 accumulation; statistics, softmax and the loss in float32; each
    layer's backward casts its parameter gradients back to the params' dtype.
    ``with_stats``: (loss, grads, the MoE layers' stacked MoeStats or None)."""
    validate_batch(batch, config)
    validate_params(params, config)
    check_precision(params, config)
    compose = functools.partial(_value_and_grad, config=config, key=key, tap=tap, with_stats=with_stats)
    if remat.GPU_UNROLL and python_loop(config, unroll=True) and not python_loop(config, tap):
        return unroll_on_gpu(compose, params, batch)
    return compose(params, batch)


def unroll_on_gpu(compose, params, batch):
    """compose(params, batch, unroll=...) with the layers unrolled in a program lowered for a
    GPU and scanned elsewhere (``jax.lax.platform_dependent``: both are traced, the platform
    lowered for keeps its own). On a GPU the scan's reads and writes of the stacked
    residuals and gradients are copies of their own (8 of the 42 ms of GPT-2's step on an
    H200, docs/benchmark.md); a TPU and the CPU keep the scan (compile time flat in depth)."""
    unrolled_, scanned = (functools.partial(compose, unroll=u) for u in (True, False))
    return jax.lax.platform_dependent(params, batch, cuda=unrolled_, rocm=unrolled_, default=scanned)


def _value_and_grad(params, batch, config: ModelConfig, key=None, tap=None, with_stats: bool = False,
                    unroll: bool = False):
    """value_and_grad's composition, its inputs checked; ``unroll``: the layers as a Python
    loop at any depth (remat.blocks_fwd)."""
    inputs, targets, mask = batch["inputs"], batch["targets"], batch.get("mask")
    segments = check_segments(batch.get("segments"), inputs)  # (B, T) or None: packed documents
    context = context_mesh()  # a context axis: the whole composition context parallel (parallel/context.py)
    if context is not None:
        if tap is not None:
            raise ValueError(f"mesh axis context={context_size(context)}: a tap runs on one device; use context=1")
        loss, grads = context_value_and_grad(params, batch, config, context, key)
        return (loss, grads, None) if with_stats else (loss, grads)
    emb = embed_params(params)

    if not config.dropout:
        key = None
    head = head_params(params, config)  # {"w": head.w or tok_embed^T, "b"?}

    # forward
    x, embed_res = embed_fwd(emb, inputs, config, None if key is None else embed_key(key, config.n_layers))
    x = upcast(x)  # (B, T, D): the residual stream runs in float32 or wider; embed_bwd casts back
    tap_forward(tap, "embed", None, x, emb)
    mesh = tensor_mesh()  # a tensor axis: the blocks tensor parallel (manual_grads/parallel/tensor.py)
    if mesh is not None and tap is not None:
        raise ValueError(f"mesh axis tensor={tensor_size(mesh)}: a tap runs on one device; use tensor=1")
    if mesh is not None:
        x, blocks_res = tensor_blocks_fwd(params["blocks"], x, config, mesh, segments, config.sequence_parallel, key)
    else:
        x, blocks_res = blocks_fwd(params["blocks"], x, config, tap, key, segments, unroll)  # (B, T, D); residuals (L, ...)
    x, stats = ffn_output(x, config)  # with n_experts: the MoE layers' statistics (L, ...)
    if config.norm != "post":
        h, ln_f_res = norm_fwd(params["ln_f"], x, config)  # (B, T, D)
        tap_forward(tap, "ln_f", x, h, params["ln_f"])
        x = h
    if mesh is not None:  # the head's vocabulary split over the tensor axis: its loss and backward at once
        loss, d_head, dx = vocab_head_loss_grads(head, x, targets, mask, mesh, config.compute_dtype,
                                                 config.logit_softcap, config.loss_chunk)
    else:
        loss, loss_res = head_loss_fwd(head, x, targets, mask, config, tap)  # ()
    if stats is not None:
        loss = loss + moe_aux_loss(stats, config)  # loss = cross entropy + the MoE auxiliary loss

    # backward, in reverse
    grads = {}
    if mesh is None:
        d_head, dx = head_loss_bwd(loss_res, jnp.ones((), loss.dtype), tap)  # (B, T, D)
    if config.tie_embeddings:  # logits = x @ tok_embed^T (+ b): dtok_embed gets dw^T below
        d_tied = d_head.pop("w").T  # (V, D)
    if d_head:
        grads["head"] = d_head
    if config.norm != "post":
        feeds = top_feeds(config, dx.dtype, key, tap) if mesh is None else None
        grads["ln_f"], dh = norm_bwd(ln_f_res, dx, feeds=feeds)  # x = ln_f(x)
        tap_backward(tap, "ln_f", dx, grads["ln_f"], dh)
        dx = dh
    if stats is not None:  # loss = cross entropy + moe_aux_loss(stats)
        dx = (dx, moe_aux_loss_bwd(stats, config))
    if mesh is not None:
        grads["blocks"], dx = tensor_blocks_bwd(blocks_res, dx)  # (B, T, D)
    else:
        grads["blocks"], dx = blocks_bwd(params["blocks"], blocks_res, dx, config, tap, key, segments, unroll)
    dx = wide(dx)  # (a Cotangent from the lowest block's ln1: its array)
    d_embed, _ = embed_bwd(embed_res, dx)  # x = drop(tok_embed[inputs] + positions)
    tap_backward(tap, "embed", dx, d_embed)
    if config.tie_embeddings:  # tok_embed feeds the embedding and the head: the two gradients add
        d_embed["tok_embed"] = d_embed["tok_embed"] + d_tied.astype(d_embed["tok_embed"].dtype)
    grads.update(d_embed)
    return (loss, grads, stats) if with_stats else (loss, grads)
