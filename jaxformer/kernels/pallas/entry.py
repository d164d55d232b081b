"""The differentiable entry point of the Pallas kernels: ``flash_attention``, the forward
kernel (forward.py) as a ``jax.custom_vjp`` whose rule is the backward kernels
(backward.py), and the pair it is made of, ``flash_core_fwd`` / ``flash_core_bwd``, which
the hand-derived gradients (manual_grads/pallas_attention.py) call inside their own
attention backward. The model's forward for attention_impl "pallas" calls
``flash_attention``; JAX's grad then runs ``flash_core_bwd``.

Shape letters as in forward.py (G = H // Hkv query heads per key/value head). The
residual keeps q, k, v (in the products' dtype), O and the row log-sum-exp lse; never the
(B, H, T, T) probabilities. Both calls go through ``on_platform`` (platform.py), so each
runs the kernels of the platform the program is lowered for, on that platform's tiles
(tiling.py); block sizes of 0 take the device's (the launch table's tuned choice on a GPU,
read only: nothing here times a kernel or writes a file).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.kernels.pallas.backward import backward_on
from jaxformer.kernels.pallas.forward import check_heads, forward_on, pallas_attention_core, segment_args
from jaxformer.kernels.pallas.platform import on_platform


class FlashRes(NamedTuple):
    """Bidirectional; CausalFlashRes (same fields) undoes the causal forward. Unpadded:
    each platform's backward pads to its own tiles. T and Dh are q's, G = H // Hkv."""
    q: jax.Array  # (B, H, T, Dh) in the products' dtype (the compute dtype, or q's own)
    k: jax.Array  # (B, Hkv, T, Dh) in the products' dtype
    v: jax.Array  # (B, Hkv, T, Dh)
    out: jax.Array  # (B, H, T, Dh) O, in the dtype of the forward's q (before the cast)
    lse: jax.Array  # (B, H, T) row log-sum-exp of S, in stats_dtype
    blocks: jax.Array  # (block_q, block_k, 0) int32, empty: the requested block sizes (0: the device's)
    window: jax.Array  # (window, 0) int32, empty: the sliding window's width (0: none), read from its shape
    segments: jax.Array | None = None  # (B, T) int: each position's document (packed rows); None: one
    key_segments: jax.Array | None = None  # (B, T) int: the keys' documents where the keys are other tokens


class CausalFlashRes(FlashRes):
    pass


def res_blocks(res: FlashRes) -> tuple[int, int]:
    """The block sizes the forward was asked for, read back from the residual's shapes."""
    return res.blocks.shape[-3], res.blocks.shape[-2]


def flash_core_fwd(q, k, v, causal: bool, block_q: int = 0, block_k: int = 0, compute_dtype=None,
                   window: int = 0, segments=None):
    """q (B, H, T, Dh), k, v (B, Hkv, T, Dh) -> (out (B, H, T, Dh) in q's dtype, FlashRes):
    the forward kernel, keeping q, k, v (in the products' dtype), O and lse. ``window``: a
    sliding window of that many keys (causal only; 0: none); ``segments`` (B, T): each
    position's document, a query reading its own document's keys only (None: one document)."""
    if window and not causal:
        raise ValueError(f"flash_attention's window {window} needs causal True (a window of past keys)")
    check_heads(q, k, v)
    cd = jnp.dtype(compute_dtype or q.dtype)
    branch = functools.partial(forward_on, causal=causal, block_q=block_q, block_k=block_k, compute_dtype=cd,
                               window=window)
    segs = [] if segments is None else [segments]
    out, lse = on_platform(branch, q, k, v, *segs)  # (B, H, T, Dh), (B, H, T)
    return out, flash_res(q, k, v, out, lse, causal, block_q, block_k, cd, window, segments)


def flash_res(q, k, v, out, lse, causal: bool, block_q: int = 0, block_k: int = 0, compute_dtype=None,
              window: int = 0, segments=None, key_segments=None) -> FlashRes:
    """The residual the backward kernels read (CausalFlashRes when causal): q, k, v in the
    products' dtype (``compute_dtype``, or q's own), O, lse, the block sizes and the window as
    empty arrays' shapes, the ids (``key_segments``: the keys' own, where they are other tokens)."""
    cd = jnp.dtype(compute_dtype or q.dtype)
    return (CausalFlashRes if causal else FlashRes)(q.astype(cd), k.astype(cd), v.astype(cd), out, lse,
                                                    jnp.zeros((block_q, block_k, 0), jnp.int32),
                                                    jnp.zeros((window, 0), jnp.int32), segments, key_segments)


def flash_core_bwd(res: FlashRes, dout):
    """dout (B, H, T, Dh) -> (dq (B, H, T, Dh), dk, dv (B, Hkv, T, Dh)) in out's dtype, by
    the backward kernels of the platform lowered for (pairs above the causal diagonal skipped)."""
    block_q, block_k = res_blocks(res)
    branch = functools.partial(backward_on, causal=isinstance(res, CausalFlashRes),
                               block_q=block_q, block_k=block_k, window=res.window.shape[0])
    return on_platform(branch, res.q, res.k, res.v, res.out, res.lse, dout,
                       *segment_args(res.segments, res.key_segments))


def _flash_fwd_rule(q, k, v, causal, block_q, block_k, compute_dtype, window, segments):
    return flash_core_fwd(q, k, v, causal, block_q, block_k, compute_dtype, window, segments)


def _flash_bwd_rule(causal, block_q, block_k, compute_dtype, window, res, dout):
    return (*flash_core_bwd(res, dout), None)  # integer segment ids: no cotangent


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def flash_attention(q, k, v, causal: bool, block_q: int = 0, block_k: int = 0, compute_dtype=None,
                    window: int = 0, segments=None):
    """q (B, H, T, Dh), k, v (B, Hkv, T, Dh), H a multiple of Hkv -> softmax(q k^T / sqrt(Dh)) v
    (B, H, T, Dh), query head h reading key/value head h // (H // Hkv), future masked if
    causal: the forward kernel, differentiable (JAX's grad runs flash_core_bwd; dk, dv come
    back (B, Hkv, T, Dh)). block_q / block_k of 0 take the device's choice (the launch
    table's on a GPU when the shape was tuned, else tiling.DEFAULT_BLOCKS); products in
    ``compute_dtype``; ``window`` W > 0 (causal): each query reads its W newest keys only;
    ``segments`` (B, T) int: each position's document (other documents' keys masked)."""
    return pallas_attention_core(q, k, v, causal, block_q, block_k, compute_dtype, window, segments)[0]


flash_attention.defvjp(_flash_fwd_rule, _flash_bwd_rule)
