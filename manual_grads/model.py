"""The whole model's loss and its gradient, by hand: value_and_grad(params, batch, config).

Forward, keeping each layer's residuals:
    x = embed(inputs)                 (B, T, D)
    x = block_l(x), l = 0 .. L-1      lax.scan; the residuals come out stacked on a leading L axis
    x = ln_f(x)                       pre-LN only
    logits = x @ head.w + head.b      (B, T, V)
    loss = cross_entropy(logits)      ()
Backward: the same list, bottom to top; the blocks run a reverse scan over the
stacked residuals, whose outputs already have params["blocks"]' stacked layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.config import ModelConfig
from jaxformer.layers import upcast
from jaxformer.model import check_precision, validate_batch
from manual_grads.block import block_bwd, block_fwd
from manual_grads.embedding import embed_bwd, embed_fwd
from manual_grads.layer_norm import layer_norm_bwd, layer_norm_fwd
from manual_grads.linear import linear_bwd, linear_fwd
from manual_grads.losses import cross_entropy_bwd, cross_entropy_fwd

EMBED_KEYS = ("tok_embed", "pos_embed")


def embed_params(params):
    """The embedding's slice of params: tok_embed, and pos_embed when positions are learned."""
    return {k: params[k] for k in EMBED_KEYS if k in params}


def _block_step_bwd(dx, res):
    """One step of the reverse scan: carry dx (B, T, D), emit this layer's dp."""
    dp, dx = block_bwd(res, dx)
    return dx, dp


def value_and_grad(params, batch, config: ModelConfig):
    """(loss, grads) for batch = {"inputs", "targets", "mask"?}; grads has the tree
    structure and dtype of params. jit it with ``static_argnums=2``.

    With config.compute_dtype (bfloat16) the products of forward and backward run in it
    with float32 accumulation; statistics, softmax and the loss in float32; each
    layer's backward casts its parameter gradients back to the params' dtype."""
    validate_batch(batch, config)
    check_precision(params, config)
    inputs, targets, mask = batch["inputs"], batch["targets"], batch.get("mask")
    eps = config.ln_eps

    # forward
    x, embed_res = embed_fwd(embed_params(params), inputs, config)  # (B, T, D)
    x = upcast(x)  # the residual stream runs in float32 or wider; embed_bwd casts back
    step = lambda x, p: block_fwd(p, x, config)  # noqa: E731
    x, blocks_res = jax.lax.scan(step, x, params["blocks"])  # (B, T, D); residuals (L, ...)
    if config.norm == "pre":
        x, ln_f_res = layer_norm_fwd(params["ln_f"], x, eps)  # (B, T, D)
    logits, head_res = linear_fwd(params["head"], x, config.compute_dtype)  # (B, T, V)
    loss, loss_res = cross_entropy_fwd(logits, targets, mask)  # ()

    # backward, in reverse
    grads = {}
    dlogits, _, _ = cross_entropy_bwd(loss_res, jnp.ones((), loss.dtype))  # (B, T, V)
    grads["head"], dx = linear_bwd(head_res, dlogits)  # (B, T, D)
    if config.norm == "pre":
        grads["ln_f"], dx = layer_norm_bwd(ln_f_res, dx)  # (B, T, D)
    dx, grads["blocks"] = jax.lax.scan(_block_step_bwd, dx, blocks_res, reverse=True)  # (B, T, D)
    d_embed, _ = embed_bwd(embed_res, dx)
    grads.update(d_embed)
    return loss, grads
