"""The head and the cross entropy, C positions at a time (jaxformer/chunked_loss.py).

Forward, per chunk c of C flattened positions (N = B * T, M = ceil(N / C) chunks):
    z_c   = x_c @ w + b                              (C, V)   never kept
    z_c   = c tanh(z_c / c)                          with a logit softcap c only
    lse_c = logsumexp(z_c)                           (C,)     kept
    loss  = sum_c sum_n w_n * (lse_n - z_c[n, target_n])
Backward, recomputing z_c one chunk at a time:
    dz_c = dloss * w_n * (exp(z_c - lse_c) - onehot(target))   undoes the weighted nll
                                    (w_n = 0 for padding and for every position of a
                                    mask that sums to 0: dz_c, dx_c, dw, db exactly 0)
    dz_c = dz_c * (1 - (z_c / c)^2)                            undoes z_c = c tanh(z_c / c)
    dx_c = dz_c @ w^T;  dw += x_c^T dz_c;  db += sum(dz_c)     undo z_c = x_c @ w + b
Mixed precision: the three products (z_c, dx_c, dw) read their inputs in the compute
dtype and accumulate in float32 (``jaxformer.layers.matmul``); lse, dz_c, the loss and
the running sums dw, db stay in float32 or wider.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.precision import stats_dtype
from jaxformer.model.chunked_loss import chunk_logits_lse, chunk_nll, chunked_inputs
from jaxformer.model.precision import matmul
from manual_grads.softcap import softcap_bwd


class ChunkedLossRes(NamedTuple):
    x: jax.Array  # (M, C, D) the head's input, flattened, zero-padded to M * C positions
    targets: jax.Array  # (M, C) int
    weights: jax.Array  # (M, C) each position's share of the mean (0 for padding), stats_dtype
    lse: jax.Array  # (M, C) log-sum-exp of each position's logits, stats_dtype
    w: jax.Array  # (D, V) the head's weight
    b: jax.Array | None  # (V,) the head's bias (the backward recomputes the logits); None: no bias
    x_shape: jax.Array  # (B, T) zeros: carries the unflattened shape of x
    products: jax.Array  # (0,) empty, in the dtype the products read: compute_dtype, or x's
    cap: jax.Array | None = None  # () the logits' softcap c, stats_dtype; None: no cap


def chunked_head_loss_fwd(head, x, targets, mask, chunk, compute_dtype=None, cap=0.0):
    """head = {"w": (D, V), "b": (V,) (optional)}, x (B, T, D), targets int (B, T), mask (B, T) or None
    -> scalar loss; the residuals keep x and lse, never the (B, T, V) logits. The head's
    product runs in ``compute_dtype`` (None: x's dtype); ``cap`` c > 0: the logits' softcap."""
    xc, tc, wc = chunked_inputs(x, targets, mask, chunk)  # (M, C, D), (M, C), (M, C)
    f = stats_dtype(x.dtype)

    def step(total, xs):
        x_c, t_c, w_c = xs
        nll, lse = chunk_nll(x_c, head["w"], head.get("b"), t_c, compute_dtype, cap or None)  # (C,), (C,)
        return total + jnp.sum(nll * w_c), lse

    total, lse = jax.lax.scan(step, jnp.zeros((), f), (xc, tc, wc))
    res = ChunkedLossRes(xc, tc, wc, lse, head["w"], head.get("b"), jnp.zeros(x.shape[:2], jnp.int8),
                         jnp.zeros((0,), compute_dtype or x.dtype), jnp.asarray(cap, f) if cap else None)
    return total.astype(x.dtype), res


def chunked_head_loss_bwd(res: ChunkedLossRes, dloss):
    """dloss () -> ({"w": (D, V), "b": (V,) if the head has a bias}, dx (B, T, D))."""
    xc, tc, wc, lse, w, b, x_shape, products, cap = res
    B, T = x_shape.shape
    f = lse.dtype
    cd = None if products.dtype == xc.dtype else products.dtype  # the forward's compute dtype

    def step(acc, xs):
        dw, db = acc
        x_c, t_c, w_c, lse_c = xs
        z, _ = chunk_logits_lse(x_c, w, b, cd, cap)  # (C, V): z_c = x_c @ w + b (capped), recomputed
        onehot = jax.nn.one_hot(t_c, z.shape[-1], dtype=f)  # (C, V)
        dz = (dloss * w_c)[:, None] * (jnp.exp(z - lse_c[:, None]) - onehot)  # nll = lse - z[target]
        if cap is not None:  # z_c = softcap(z_c, cap)
            dz = softcap_bwd(z / cap, dz)
        dx_c = matmul(dz, w.T.astype(f), cd).astype(x_c.dtype)  # (C, D)
        return (dw + matmul(x_c.T.astype(f), dz, cd), db + jnp.sum(dz, axis=0)), dx_c

    zeros = (jnp.zeros(w.shape, f), jnp.zeros(w.shape[-1:], f))
    (dw, db), dxc = jax.lax.scan(step, zeros, (xc, tc, wc, lse))
    dx = dxc.reshape(-1, xc.shape[-1])[:B * T].reshape(B, T, -1)  # padding dropped
    if b is None:
        return {"w": dw.astype(w.dtype)}, dx
    return {"w": dw.astype(w.dtype), "b": db.astype(b.dtype)}, dx
