"""The whole model's loss and its gradient, by hand: value_and_grad(params, batch, config).

Forward, keeping each layer's residuals:
    x = embed(inputs)                 (B, T, D)
    x = block_l(x), l = 0 .. L-1      lax.scan; the residuals come out stacked on a leading L axis
                                      (remat "block": only each block's input, manual_grads/remat.py)
    x = ln_f(x)                       pre-LN only
    logits = x @ head.w + head.b      (B, T, V)
    loss = cross_entropy(logits)      ()   (loss_chunk > 0: both, chunk by chunk, chunked_loss.py)
Backward: the same list, bottom to top; the blocks run a reverse scan over the
stacked residuals, whose outputs already have params["blocks"]' stacked layout.
Attention is full or blockwise (manual_grads/blockwise.py), as config.attention_impl says.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxformer.model.config import ModelConfig
from jaxformer.model.precision import upcast
from jaxformer.model.validate import check_precision, validate_batch
from jaxformer.model.params import validate_params
from manual_grads.chunked_loss import chunked_head_loss_bwd, chunked_head_loss_fwd
from manual_grads.embedding import embed_bwd, embed_fwd
from manual_grads.layer_norm import layer_norm_bwd, layer_norm_fwd
from manual_grads.linear import linear_bwd, linear_fwd
from manual_grads.losses import cross_entropy_bwd, cross_entropy_fwd
from manual_grads.remat import blocks_bwd, blocks_fwd

EMBED_KEYS = ("tok_embed", "pos_embed")


def embed_params(params):
    """The embedding's slice of params: tok_embed, and pos_embed when positions are learned."""
    return {k: params[k] for k in EMBED_KEYS if k in params}


def value_and_grad(params, batch, config: ModelConfig):
    """(loss, grads) for batch = {"inputs", "targets", "mask"?}; grads has the tree
    structure and dtype of params. jit it with ``static_argnums=2``.

    With config.compute_dtype (bfloat16) the products of forward and backward run in it
    with float32 accumulation; statistics, softmax and the loss in float32; each
    layer's backward casts its parameter gradients back to the params' dtype."""
    validate_batch(batch, config)
    validate_params(params, config)
    check_precision(params, config)
    inputs, targets, mask = batch["inputs"], batch["targets"], batch.get("mask")
    eps = config.ln_eps

    # forward
    x, embed_res = embed_fwd(embed_params(params), inputs, config)  # (B, T, D)
    x = upcast(x)  # the residual stream runs in float32 or wider; embed_bwd casts back
    x, blocks_res = blocks_fwd(params["blocks"], x, config)  # (B, T, D); residuals (L, ...)
    if config.norm == "pre":
        x, ln_f_res = layer_norm_fwd(params["ln_f"], x, eps)  # (B, T, D)
    if config.loss_chunk:
        loss, loss_res = chunked_head_loss_fwd(params["head"], x, targets, mask, config.loss_chunk,
                                               config.compute_dtype)
    else:
        logits, head_res = linear_fwd(params["head"], x, config.compute_dtype)  # (B, T, V)
        loss, loss_res = cross_entropy_fwd(logits, targets, mask)  # ()

    # backward, in reverse
    grads = {}
    dloss = jnp.ones((), loss.dtype)
    if config.loss_chunk:
        grads["head"], dx = chunked_head_loss_bwd(loss_res, dloss)  # (B, T, D)
    else:
        dlogits, _, _ = cross_entropy_bwd(loss_res, dloss)  # (B, T, V)
        grads["head"], dx = linear_bwd(head_res, dlogits)  # (B, T, D)
    if config.norm == "pre":
        grads["ln_f"], dx = layer_norm_bwd(ln_f_res, dx)  # (B, T, D)
    grads["blocks"], dx = blocks_bwd(params["blocks"], blocks_res, dx, config)  # (B, T, D)
    d_embed, _ = embed_bwd(embed_res, dx)
    grads.update(d_embed)
    return loss, grads
