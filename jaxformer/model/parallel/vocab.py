"""The vocabulary split over the tensor axis (Megatron-LM's vocab-parallel head and cross
entropy): device i of t holds the head's columns i V/t .. (i+1) V/t - 1 (w (D, V/t), b (V/t,)),
computes its (..., V/t) slice of the logits, and the loss comes from three reductions over the
axis, so no device ever holds a whole (..., V) row:

    m        = pmax(max(logits_i))                    the row's largest logit (no gradient: it cancels)
    logz     = m + log(psum(sum(exp(logits_i - m))))  the log-sum-exp over every device's slice
    target   = psum(logits_i[y - i V/t] where y is among device i's ids, else 0)
    nll      = logz - target
    loss     = psum(sum(nll * mask)) / psum(sum(mask))     over the batch axes too (mask_weights)

The manual backward is manual_grads/parallel/vocab.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxformer.model.linear import linear
from jaxformer.model.parallel.regions import TENSOR, copy_to_tensor
from jaxformer.model.precision import upcast


def check_vocab(vocab_size: int, t: int) -> None:
    """A ValueError in one line unless a tensor axis of size t splits the vocabulary."""
    if vocab_size % t:
        raise ValueError(f"mesh axis tensor={t} does not divide vocab_size {vocab_size}: the tensor size must "
                         "divide vocab_size")


def local_targets(targets, v_local: int):
    """(index into device i's slice, whether the target is among device i's ids) of each target."""
    local = targets - jax.lax.axis_index(TENSOR) * v_local
    inside = (local >= 0) & (local < v_local)
    return jnp.where(inside, local, 0), inside  # 0: any index in range; ``inside`` drops it


def vocab_nll_and_logz(logits, targets):
    """Device i's logits (..., V/t) and the targets (...) -> (nll, logz), each (...) and the same on
    every device: -log softmax[target] and the log-sum-exp over the whole vocabulary."""
    logits = upcast(logits)
    m = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), TENSOR)  # (...): no gradient, it cancels
    logz = m + jnp.log(jax.lax.psum(jnp.sum(jnp.exp(logits - m[..., None]), axis=-1), TENSOR))
    local, inside = local_targets(targets, logits.shape[-1])
    picked = jnp.take_along_axis(logits, local[..., None], axis=-1)[..., 0]
    target_logit = jax.lax.psum(jnp.where(inside, picked, 0), TENSOR)
    return logz - target_logit, logz


def batch_weights(nll, mask, batch_axes):
    """Each position's share of the mean over the global batch (split over ``batch_axes``):
    mask / psum(sum(mask)), as losses.mask_weights (a mask that sums to 0 gives weights of 0)."""
    mask = jnp.ones_like(nll) if mask is None else mask.astype(nll.dtype)
    den = jnp.sum(mask)
    if batch_axes:
        den = jax.lax.psum(den, batch_axes)
    return mask / jnp.where(den > 0, den, 1)


def batch_mean(nll, mask, batch_axes):
    """The mean of nll over every position of the global batch, weighted by ``mask`` (batch_weights)."""
    total = jnp.sum(nll * batch_weights(nll, mask, batch_axes))
    return jax.lax.psum(total, batch_axes) if batch_axes else total


def vocab_head_loss_local(p, x, targets, mask, compute_dtype=None, batch_axes=()):
    """Under shard_map: the head's columns of device i ``p`` ({"w": (D, V/t), "b"?}), x (B, T, D)
    replicated over tensor, targets and mask (B, T) -> the mean cross entropy (the same everywhere)."""
    logits = linear(copy_to_tensor(x), p["w"], p.get("b"), compute_dtype)  # (B, T, V/t): device i's slice
    nll, _ = vocab_nll_and_logz(logits, targets)
    return batch_mean(nll, mask, batch_axes)


def head_specs(p) -> dict:
    """The head's PartitionSpecs: w (D, V) and b (V,) split along V over the tensor axis."""
    return {n: PartitionSpec(*([None] * (v.ndim - 1)), TENSOR) for n, v in p.items()}


def on_vocab_mesh(local, p, x, targets, mask, mesh, compute_dtype=None, out=lambda rows: PartitionSpec(),
                  check_vma: bool = True):
    """``local(p, x, targets, mask, compute_dtype, batch_axes)`` under shard_map on ``mesh``: the
    head's p split along V over the tensor axis, x, targets and mask split along B over the
    others; ``out(rows)``: the out_specs (rows: the batch's spec)."""
    check_vocab(p["w"].shape[-1], dict(mesh.shape)[TENSOR])
    axes = tuple(a for a in mesh.axis_names if a != TENSOR)
    rows = PartitionSpec(axes or None)
    return jax.shard_map(lambda *a: local(*a, compute_dtype, axes), mesh=mesh,
                         in_specs=(head_specs(p), rows, rows, rows), out_specs=out(rows),
                         check_vma=check_vma)(p, x, targets, mask)


def vocab_head_loss(p, x, targets, mask, mesh, compute_dtype=None):
    """The head and the mean cross entropy with the vocabulary split over ``mesh``'s tensor axis
    (the batch over its other axes): p {"w": (D, V), "b"?}, x (B, T, D), targets (B, T) -> ()."""
    return on_vocab_mesh(vocab_head_loss_local, p, x, targets, mask, mesh, compute_dtype)
