"""The vocab-parallel head and cross entropy's backward by hand (the forward's lines quoted from
jaxformer/model/parallel/vocab.py). Per device i, bottom to top:

    loss = psum(sum(nll * weights))                     dnll = dloss * weights (batch_weights: mask / psum(sum(mask)))
    nll = logz - target                                 dlogz = dnll, dtarget = -dnll
    target = psum(where(inside, z_i[local], 0))         dz_i[local] -= dnll where inside
                                                        (psum's transpose: every device's dtarget is dnll)
    logz = m + log(psum(sum(exp(z_i - m))))             dz_i += dnll * exp(z_i - logz)
                                                        (m carries no gradient; the psum's cotangent
                                                        is the same everywhere)
    z_i = where(id < V, z_i, -inf)                      the padding's dz is exp(-inf) = 0 already
    z_i = c tanh(z_i / c)                               softcap_bwd (with the cap only)
    z_i = copy_to_tensor(x) @ w_i + b_i                 linear_bwd: dw_i, db_i device i's columns;
                                                        dx = psum(dh_i) (copy_to_tensor_bwd)
Over the batch axes dw and db are summed (each device's rows gave part of them). With loss_chunk
C > 0 a first pass over the chunks gives the loss and each position's logz, a second recomputes
each chunk's z_i and adds its dw_i, db_i; dx, one chunk at a time, is summed over the axis once,
at the end. No (..., V) row is formed on any device, forward or backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxformer.model.parallel.regions import TENSOR, token_axes
from jaxformer.model.parallel.vocab import (batch_weights, chunked_rows, head_specs, local_targets, mask_padding,
                                            on_vocab_mesh, vocab_nll_and_logz)
from jaxformer.model.precision import stats_dtype, upcast
from manual_grads.linear import linear_bwd, linear_fwd
from manual_grads.parallel.regions import copy_to_tensor_bwd
from manual_grads.softcap import softcap_bwd, softcap_fwd


def logits_fwd(p, h, vocab_size: int, compute_dtype=None, cap: float = 0.0):
    """vocab_logits with its residuals: (z_i in stats_dtype, (the product's, the cap's tanh or
    None, the product's dtype))."""
    z, lin_res = linear_fwd(p, h, compute_dtype)  # z_i = copy_to_tensor(x) @ w_i + b_i
    out = z.dtype
    z, t = softcap_fwd(upcast(z), cap) if cap else (upcast(z), None)  # z_i = c tanh(z_i / c)
    return mask_padding(z, vocab_size), (lin_res, t, out)


def logits_bwd(res, z, logz, targets, dnll):
    """dnll (...) -> (dp_i, device i's part of dh (..., D)), through the nll, the cap and the product."""
    lin_res, t, out = res
    dz = dnll[..., None] * jnp.exp(z - logz[..., None])  # logz = m + log(psum(sum(exp(z_i - m))))
    local, inside = local_targets(targets, z.shape[-1])  # target = psum(where(inside, z_i[local], 0))
    dz = dz - jax.nn.one_hot(local, z.shape[-1], dtype=dz.dtype) * (inside * dnll)[..., None]
    if t is not None:
        dz = softcap_bwd(t, dz)  # z_i = c tanh(z_i / c)
    return linear_bwd(lin_res, dz.astype(out), round_dx=False)  # z_i = h @ w_i + b_i


def vocab_head_loss_grads_local(p, x, targets, mask, batch_axes=(), *, vocab_size: int, compute_dtype=None,
                                cap: float = 0.0, chunk: int = 0):
    """Under shard_map: (loss, dp (device i's columns), dx (B, T, D), the same everywhere)."""
    h = x  # copy_to_tensor(x): the identity on values; its backward is the psum at the end
    f = stats_dtype(x.dtype)
    weights = batch_weights(mask, targets.shape, f, batch_axes)  # (B, T): mask / psum(sum(mask))
    logits = lambda h: logits_fwd(p, h, vocab_size, compute_dtype, cap)  # noqa: E731
    # loss = psum(sum(nll * weights)): dnll = weights
    if not chunk:
        z, res = logits(h)
        nll, logz = vocab_nll_and_logz(z, targets)
        total = jnp.sum(nll * weights)
        dp, dh = logits_bwd(res, z, logz, targets, weights)
    else:
        hc, tc, wc = chunked_rows(chunk, h, targets, weights)  # (M, C, D), (M, C), (M, C)

        def forward(total, xs):  # the loss and each position's logz
            h_c, t_c, w_c = xs
            nll, logz = vocab_nll_and_logz(logits(h_c)[0], t_c)
            return total + jnp.sum(nll * w_c), logz

        def backward(dp, xs):  # each chunk's logits again, and their gradients
            h_c, t_c, w_c, logz_c = xs
            z, res = logits(h_c)
            dp_c, dh_c = logits_bwd(res, z, logz_c, t_c, w_c)
            return jax.tree_util.tree_map(jnp.add, dp, dp_c), dh_c

        total, logz = jax.lax.scan(forward, jnp.zeros((), f), (hc, tc, wc))
        zeros = jax.tree_util.tree_map(jnp.zeros_like, p)
        dp, dhc = jax.lax.scan(backward, zeros, (hc, tc, wc, logz))
        B, T = targets.shape
        dh = dhc.reshape(-1, dhc.shape[-1])[:B * T].reshape(B, T, -1)  # the padding dropped
    dx = copy_to_tensor_bwd(dh)  # z_i = copy_to_tensor(x) @ w_i + b_i
    if batch_axes:
        total = jax.lax.psum(total, batch_axes)
        dp = jax.tree_util.tree_map(lambda g: jax.lax.psum(g, batch_axes), dp)
    return total, dp, dx


def vocab_head_loss_grads(p, x, targets, mask, mesh, compute_dtype=None, cap: float = 0.0, chunk: int = 0):
    """vocab_head_loss and its gradients by hand: (loss, dp laid out as p, dx (B, T, D))."""
    V = p["w"].shape[-1]
    loss, dp, dx = on_vocab_mesh(vocab_head_loss_grads_local, p, x, targets, mask, mesh,
                                 out=lambda rows: (PartitionSpec(), head_specs(p), rows), check_vma=False,
                                 compute_dtype=compute_dtype, cap=cap, chunk=chunk)
    return loss, {n: g[..., :V] for n, g in dp.items()}, dx  # z = where(id < V, ...): the padding dropped


def vocab_token_embedding_bwd(ids, table, dx, mesh):
    """Undoes ``x = vocab_token_embedding(table, ids)``: ids (B, T), table (V, D) (kept for its
    shape and dtype), dx (B, T, D) -> dtable (V, D), its rows split over the tensor axis.
        x = psum(where(inside, table_i[local], 0))    the psum's cotangent is dx on every device;
                                                      dtable_i = scatter-add of dx's rows into the
                                                      rows of device i's ids (zero elsewhere)
    summed over the axes the tokens split over (each device's part of the batch)."""
    V, D = table.shape
    t = dict(mesh.shape)[TENSOR]
    v_local = -(-V // t)  # padded_rows: V up to a multiple of t
    axes, rows = token_axes(mesh)

    def body(ids, dx):
        local, inside = local_targets(ids, v_local)  # table_i[local] where inside
        d = jnp.zeros((v_local, D), dx.dtype).at[local.reshape(-1)].add(
            jnp.where(inside[..., None], dx, 0).reshape(-1, D))
        return jax.lax.psum(d, axes) if axes else d

    dtable = jax.shard_map(body, mesh=mesh, in_specs=(rows, rows), out_specs=PartitionSpec(TENSOR, None),
                           check_vma=False)(ids, dx)
    return dtable[:V].astype(table.dtype)  # the padding rows dropped
