"""The head and the cross entropy, C positions at a time: the (B, T, V) logits never exist.

Shape letters: N = B * T positions, C the chunk, M = ceil(N / C) chunks,
Np = M * C the padded count.

    z_n  = x_n @ w + b                     (c tanh(z_n / c) with a logit softcap c)
    loss = sum_n w_n * (logsumexp(z_n) - z_n[target_n])
    w_n  = mask_n / sum(mask)              (1 / N without a mask; all 0 when the mask sums
                                            to 0: loss 0, gradient 0; losses.mask_weights)

The positions are flattened, padded up to Np (padding gets weight 0) and cut
into M chunks; a ``lax.scan`` adds each chunk's weighted negative log-likelihood.
Log-sum-exp and the sum are kept in at least float32; the head's product x_c @ w
runs in ``compute_dtype`` with float32 accumulation (``jaxformer.layers.matmul``).
Under JAX's ``grad`` each chunk is a ``jax.checkpoint``, so autodiff too keeps one
chunk of logits at a time; the manual backward (manual_grads/chunked_loss.py)
recomputes them itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.model.precision import stats_dtype
from jaxformer.model.linear import linear
from jaxformer.model.losses import mask_weights
from jaxformer.model.softcap import softcap


def position_weights(targets, mask, dtype):
    """(...) weight of each position in the mean: mask / sum(mask) (losses.mask_weights:
    all 0 when the mask sums to 0), or 1 / N."""
    if mask is None:
        return jnp.full(targets.shape, 1.0 / targets.size, dtype)
    return mask_weights(mask, dtype)


def to_chunks(x, chunk: int):
    """(N, ...) -> (M, C, ...), zero-padded from N up to Np = M * C."""
    N = x.shape[0]
    M = -(-N // chunk)
    x = jnp.pad(x, [(0, M * chunk - N)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape((M, chunk) + x.shape[1:])


def chunk_logits_lse(x_c, w, b, compute_dtype=None, cap=None):
    """x_c (C, D) -> (logits (C, V), lse (C,)), both in stats_dtype; the product in compute_dtype;
    the logits capped to cap * tanh(logits / cap) where ``cap`` (a float or 0-d array) is not None."""
    logits = linear(x_c, w, b, compute_dtype).astype(stats_dtype(x_c.dtype))  # (C, V)
    if cap is not None:
        logits = softcap(logits, cap)
    return logits, jax.nn.logsumexp(logits, axis=-1)


def chunk_nll(x_c, w, b, t_c, compute_dtype=None, cap=None):
    """x_c (C, D), t_c int (C,) -> -log softmax(z)[t_c] (C,), and lse (C,); z = x_c @ w + b, capped
    with ``cap``."""
    logits, lse = chunk_logits_lse(x_c, w, b, compute_dtype, cap)
    target_logit = jnp.take_along_axis(logits, t_c[:, None], axis=-1)[:, 0]  # (C,)
    return lse - target_logit, lse


def chunked_inputs(x, targets, mask, chunk: int):
    """Flatten and chunk: (x (M, C, D), targets (M, C), weights (M, C) in stats_dtype)."""
    D = x.shape[-1]
    f = stats_dtype(x.dtype)
    weights = position_weights(targets, mask, f)  # (B, T)
    return (to_chunks(x.reshape(-1, D), chunk), to_chunks(targets.reshape(-1), chunk),
            to_chunks(weights.reshape(-1), chunk))


def chunked_head_loss(head, x, targets, mask, chunk: int, compute_dtype=None, cap: float = 0.0):
    """head = {"w": (D, V), "b": (V,) (optional)}, x (B, T, D), targets int (B, T), mask (B, T) or None
    -> the mean cross entropy of x @ w + b, as cross_entropy(linear(x, w, b, compute_dtype),
    targets, mask); ``cap`` c > 0: of c tanh((x @ w + b) / c), the logits' softcap (0: none)."""
    xc, tc, wc = chunked_inputs(x, targets, mask, chunk)

    @jax.checkpoint
    def chunk_loss(x_c, t_c, w_c):
        nll, _ = chunk_nll(x_c, head["w"], head.get("b"), t_c, compute_dtype, cap or None)  # (C,)
        return jnp.sum(nll * w_c)

    def step(total, xs):
        return total + chunk_loss(*xs), None

    total, _ = jax.lax.scan(step, jnp.zeros((), stats_dtype(x.dtype)), (xc, tc, wc))
    return total.astype(x.dtype)
