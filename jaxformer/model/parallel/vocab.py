"""The vocabulary split over the tensor axis (Megatron-LM's vocab-parallel head and cross
entropy): device i of t holds the head's columns i V/t .. (i+1) V/t - 1 (w (D, V/t), b (V/t,)),
computes its (..., V/t) slice of the logits, and the loss comes from three reductions over the
axis, so no device ever holds a whole (..., V) row:

    z_i      = c tanh((x @ w_i + b_i) / c)            device i's logits (the cap c only with logit_softcap)
    m        = pmax(max(z_i))                         the row's largest logit (no gradient: it cancels)
    logz     = m + log(psum(sum(exp(z_i - m))))       the log-sum-exp over every device's slice
    target   = psum(z_i[y - i V/t] where y is among device i's ids, else 0)
    nll      = logz - target
    loss     = psum(sum(nll * weights))               weights = mask / psum(sum(mask)), over the batch axes too

A vocabulary that t does not divide is padded with zero columns up to the next multiple of t;
the padding's logits are -inf (``mask_padding``), outside every softmax, and their gradient is
dropped with the padding. With loss_chunk C > 0 each device runs its rows C positions at a
time (chunked_loss.py's chunks), so a device holds (C, V/t) logits at once.

``jaxformer.loss_fn`` and ``manual_grads.value_and_grad`` run the head this way on a mesh with a
tensor axis (parallel/tensor.tensor_mesh); the manual backward is manual_grads/parallel/vocab.py.
The embedding's rows split the same way (``vocab_token_embedding``): device i looks up the ids
among its V/t rows, and the parts are summed over the axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxformer.model.chunked_loss import to_chunks
from jaxformer.model.linear import linear
from jaxformer.model.parallel.regions import TENSOR, copy_to_tensor, reduce_from_tensor, token_axes
from jaxformer.model.precision import stats_dtype, upcast
from jaxformer.model.softcap import softcap


def padded(p, t: int) -> dict:
    """The head's params {"w": (D, V), "b"?: (V,)} with zero columns up to a multiple of t."""
    extra = -p["w"].shape[-1] % t
    if not extra:
        return p
    return {n: jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, extra)]) for n, v in p.items()}


def mask_padding(logits, vocab_size: int):
    """Device i's logits (..., V/t) with the padding columns (ids >= vocab_size) at -inf."""
    v_local = logits.shape[-1]
    if v_local * jax.lax.axis_size(TENSOR) == vocab_size:
        return logits
    ids = jax.lax.axis_index(TENSOR) * v_local + jnp.arange(v_local)
    return jnp.where(ids < vocab_size, logits, -jnp.inf)


def vocab_logits(p, x, vocab_size: int, compute_dtype=None, cap: float = 0.0):
    """x (..., D) -> device i's logits (..., V/t) in stats_dtype: x @ w_i + b_i, capped to
    c tanh(z / c) with ``cap`` c > 0, the padding at -inf."""
    logits = upcast(linear(x, p["w"], p.get("b"), compute_dtype))
    if cap:
        logits = softcap(logits, cap)
    return mask_padding(logits, vocab_size)


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


def batch_weights(mask, shape, dtype, batch_axes):
    """Each position's share (``shape``, ``dtype``) of the mean over the global batch (split over
    ``batch_axes``): mask / psum(sum(mask)), as losses.mask_weights (a mask that sums to 0 gives
    weights of 0); no mask: every position alike."""
    mask = jnp.ones(shape, dtype) if mask is None else mask.astype(dtype)
    den = jnp.sum(mask)
    if batch_axes:
        den = jax.lax.psum(den, batch_axes)
    return mask / jnp.where(den > 0, den, 1)


def chunked_rows(chunk: int, *arrays):
    """Each (B, T, ...) array -> (M, C, ...): the B T positions flattened, zero-padded, in chunks."""
    return tuple(to_chunks(a.reshape(-1, *a.shape[2:]), chunk) for a in arrays)


def vocab_head_loss_local(p, x, targets, mask, batch_axes=(), *, vocab_size: int, compute_dtype=None,
                          cap: float = 0.0, chunk: int = 0):
    """Under shard_map: the head's columns of device i ``p`` ({"w": (D, V/t), "b"?}), x (B, T, D)
    replicated over tensor, targets and mask (B, T) -> the mean cross entropy (the same everywhere)."""
    h = copy_to_tensor(x)
    f = stats_dtype(x.dtype)
    weights = batch_weights(mask, targets.shape, f, batch_axes)  # (B, T)

    def nll_sum(h, targets, weights):
        nll, _ = vocab_nll_and_logz(vocab_logits(p, h, vocab_size, compute_dtype, cap), targets)
        return jnp.sum(nll * weights)

    if chunk:  # C positions at a time; jax.grad keeps no chunk's logits (jax.checkpoint)
        step = jax.checkpoint(nll_sum)
        total = jnp.sum(jax.lax.map(lambda xs: step(*xs), chunked_rows(chunk, h, targets, weights)))
    else:
        total = nll_sum(h, targets, weights)
    return jax.lax.psum(total, batch_axes) if batch_axes else total


def head_specs(p) -> dict:
    """The head's PartitionSpecs: w (D, V) and b (V,) split along V over the tensor axis."""
    return {n: PartitionSpec(*([None] * (v.ndim - 1)), TENSOR) for n, v in p.items()}


def on_vocab_mesh(local, p, x, targets, mask, mesh, out=lambda rows: PartitionSpec(), check_vma: bool = True,
                  **options):
    """``local(p, x, targets, mask, batch_axes, vocab_size=V, **options)`` under shard_map on ``mesh``:
    the head's p padded to a multiple of t columns and split along V over the tensor axis, x,
    targets and mask split along B over the others (and along T over a context axis, where the
    mesh has one: its tokens in that axis' order, summed over it as over the rows); ``out(rows)``:
    the out_specs (rows: the batch's spec)."""
    axes, rows = token_axes(mesh)
    body = functools.partial(local, batch_axes=axes, vocab_size=p["w"].shape[-1], **options)
    p = padded(p, dict(mesh.shape)[TENSOR])
    return jax.shard_map(body, mesh=mesh, in_specs=(head_specs(p), rows, rows, rows), out_specs=out(rows),
                         check_vma=check_vma)(p, x, targets, mask)


def vocab_head_loss(p, x, targets, mask, mesh, compute_dtype=None, cap: float = 0.0, chunk: int = 0):
    """The head and the mean cross entropy with the vocabulary split over ``mesh``'s tensor axis
    (the batch over its other axes): p {"w": (D, V), "b"?}, x (B, T, D), targets (B, T) -> ()."""
    return on_vocab_mesh(vocab_head_loss_local, p, x, targets, mask, mesh, compute_dtype=compute_dtype, cap=cap,
                         chunk=chunk)


# ----------------------------------------------------------------------------
# the embedding's rows split over the tensor axis (Megatron-LM's VocabParallelEmbedding)


def padded_rows(table, t: int):
    """tok_embed (V, D) with zero rows up to a multiple of t (no id reads them)."""
    extra = -table.shape[0] % t
    return jnp.pad(table, [(0, extra), (0, 0)]) if extra else table


def local_rows(table_i, ids):
    """Under shard_map: device i's rows table_i (V/t, D), ids (...) -> its part of table[ids]:
    the rows of the ids among its own, zero for the others (``local_targets``)."""
    local, inside = local_targets(ids, table_i.shape[0])
    return jnp.where(inside[..., None], jnp.take(table_i, local, axis=0), 0)


def vocab_token_embedding(table, ids, mesh):
    """table (V, D) with its rows split over ``mesh``'s tensor axis, ids (B, T) -> table[ids]
    (B, T, D): each device looks up the ids among its V/t rows and the parts are summed over the
    axis (reduce_from_tensor), so no device needs the whole table:
        x = psum(where(id among device i's rows, table_i[id - i V/t], 0))
    The ids (and x) split as the batch's tokens are (``token_axes``), replicated over tensor."""
    _, rows = token_axes(mesh)
    table = padded_rows(table, dict(mesh.shape)[TENSOR])
    body = lambda table_i, ids: reduce_from_tensor(local_rows(table_i, ids))  # noqa: E731
    return jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec(TENSOR, None), rows), out_specs=rows)(table, ids)
