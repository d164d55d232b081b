"""The vocab-parallel head and cross entropy's backward by hand (the forward's lines quoted from
jaxformer/model/parallel/vocab.py). Per device i, bottom to top:

    loss = psum(sum(nll * weights))                     dnll = dloss * weights (batch_weights: mask / psum(sum(mask)))
    nll = logz - target                                 dlogz = dnll, dtarget = -dnll
    target = psum(where(inside, logits_i[local], 0))    dlogits_i[local] -= dnll where inside
                                                        (psum's transpose: every device's dtarget is dnll)
    logz = m + log(psum(sum(exp(logits_i - m))))        dlogits_i += dnll * exp(logits_i - logz)
                                                        (m carries no gradient; the psum's cotangent
                                                        is the same everywhere)
    logits_i = copy_to_tensor(x) @ w_i + b_i            linear_bwd: dw_i, db_i device i's columns;
                                                        dx = psum(dh_i) (copy_to_tensor_bwd)
Over the batch axes dw and db are summed (each device's rows gave part of them). No (..., V)
row is formed on any device, forward or backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxformer.model.precision import upcast
from jaxformer.model.parallel.vocab import batch_weights, head_specs, local_targets, on_vocab_mesh, vocab_nll_and_logz
from manual_grads.linear import linear_bwd, linear_fwd
from manual_grads.parallel.regions import copy_to_tensor_bwd


def vocab_head_loss_grads_local(p, x, targets, mask, compute_dtype=None, batch_axes=()):
    """Under shard_map: (loss, dp (device i's columns), dx (B, T, D), the same everywhere)."""
    h = x  # copy_to_tensor(x): the identity on values; its backward is the psum below
    logits, lin_res = linear_fwd(p, h, compute_dtype)  # (B, T, V/t)
    nll, logz = vocab_nll_and_logz(logits, targets)
    weights = batch_weights(nll, mask, batch_axes)  # (B, T): mask / psum(sum(mask))
    loss = jnp.sum(nll * weights)
    loss = jax.lax.psum(loss, batch_axes) if batch_axes else loss
    # loss = psum(sum(nll * weights))
    dnll = weights  # (B, T)
    # nll = logz - target; logz = m + log(psum(sum(exp(logits_i - m)))): the softmax of device i's slice
    dlogits = dnll[..., None] * jnp.exp(upcast(logits) - logz[..., None])
    # target = psum(where(inside, logits_i[local], 0))
    local, inside = local_targets(targets, logits.shape[-1])
    dlogits = dlogits - jax.nn.one_hot(local, logits.shape[-1], dtype=dlogits.dtype) * (inside * dnll)[..., None]
    dp, dh = linear_bwd(lin_res, dlogits.astype(logits.dtype), round_dx=False)
    dx = copy_to_tensor_bwd(dh)  # logits_i = copy_to_tensor(x) @ w_i + b_i
    if batch_axes:
        dp = jax.tree_util.tree_map(lambda g: jax.lax.psum(g, batch_axes), dp)
    return loss, dp, dx


def vocab_head_loss_grads(p, x, targets, mask, mesh, compute_dtype=None):
    """vocab_head_loss and its gradients by hand: (loss, dp laid out as p, dx (B, T, D))."""
    return on_vocab_mesh(vocab_head_loss_grads_local, p, x, targets, mask, mesh, compute_dtype,
                         out=lambda rows: (PartitionSpec(), head_specs(p), rows), check_vma=False)
