"""Multi-head attention: full (the (B, H, T, T) probabilities), blockwise (a lax loop
over blocks), pallas (the same online softmax as one Pallas kernel) or cudnn (cuDNN's).

Head h of attention uses columns h*Dh:(h+1)*Dh of wq/wk/wv (Dh = D // H); q, k and v
come out of one product x @ [wq | wk | wv]; scores are scaled by 1/sqrt(Dh)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxformer.model.blockwise import blockwise_attention_core
from jaxformer.model.dropout import dropout
from jaxformer.model.linear import linear
from jaxformer.model.pallas_backward import flash_attention
from jaxformer.model.precision import matmul, upcast

def split_heads(x, n_heads):
    """(B, T, D) -> (B, H, T, Dh): head h takes features h*Dh:(h+1)*Dh."""
    B, T, D = x.shape
    return x.reshape(B, T, n_heads, D // n_heads).transpose(0, 2, 1, 3)


def merge_heads(x):
    """(B, H, T, Dh) -> (B, T, D), the inverse of split_heads."""
    B, H, T, Dh = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * Dh)


def qkv_weights(p):
    """The three input projections side by side: w = [wq | wk | wv] (D, 3D), b (3D,)
    (None without biases, ModelConfig.bias False)."""
    b = jnp.concatenate([p["bq"], p["bk"], p["bv"]]) if "bq" in p else None
    return jnp.concatenate([p["wq"], p["wk"], p["wv"]], axis=1), b


def split_qkv(qkv, n_heads):
    """(B, T, 3D) -> q, k, v (B, H, T, Dh) each, in one transpose: columns j*D:(j+1)*D
    are q, k, v (j = 0, 1, 2), and head h of each takes its features h*Dh:(h+1)*Dh."""
    B, T, D3 = qkv.shape
    qkv = qkv.reshape(B, T, 3, n_heads, D3 // (3 * n_heads)).transpose(2, 0, 3, 1, 4)
    return qkv[0], qkv[1], qkv[2]  # (B, H, T, Dh) each


def merge_qkv(q, k, v):
    """q, k, v (B, H, T, Dh) -> (B, T, 3D), the inverse of split_qkv."""
    B, H, T, Dh = q.shape
    return jnp.stack([q, k, v]).transpose(1, 3, 0, 2, 4).reshape(B, T, 3 * H * Dh)


def qkv_heads(p, x, n_heads, compute_dtype=None):
    """x (B, T, D) -> q, k, v (B, H, T, Dh): one product x @ [wq | wk | wv] + [bq | bk | bv]."""
    w, b = qkv_weights(p)
    return split_qkv(linear(x, w, b, compute_dtype), n_heads)  # (B, H, T, Dh) each


def causal_mask(T):
    """(T, T) bool, True where query t may attend to key s (s <= t)."""
    return jnp.tril(jnp.ones((T, T), dtype=bool))


def attention_scores(q, k, compute_dtype=None):
    """q (B, H, Tq, Dh), k (B, H, Tk, Dh) -> q k^T / sqrt(Dh) (B, H, Tq, Tk): the product in
    ``compute_dtype``, the scores in float32 or wider."""
    return upcast(matmul(q, jnp.swapaxes(k, -1, -2), compute_dtype)) / math.sqrt(q.shape[-1])


def masked_softmax(scores, mask=None):
    """softmax over the last axis of scores (..., Tk) where mask (broadcast; None: all) is
    True: masked scores get the dtype's minimum, and the row max (no gradient) is subtracted."""
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    scores = scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    e = jnp.exp(scores)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def attention_probs(q, k, causal, compute_dtype=None):
    """q, k (B, H, T, Dh) -> softmax(q k^T / sqrt(Dh)) (B, H, T, T), future masked if causal.
    q k^T runs in ``compute_dtype``; the softmax in float32 or wider."""
    scores = attention_scores(q, k, compute_dtype)  # (B, H, T, T)
    return masked_softmax(scores, causal_mask(q.shape[-2]) if causal else None)


def attention_options(config) -> dict:
    """The keyword arguments of ``attention`` a ModelConfig sets: impl, block sizes, dropout."""
    return dict(impl=config.attention_impl, block=config.attention_block,
                block_q=config.pallas_block_q, block_k=config.pallas_block_k,
                dropout_rate=config.dropout)


def attention(p, x, n_heads, causal, compute_dtype=None, impl="full", block=128, block_q=0, block_k=0,
              dropout_rate=0.0, key=None):
    """p = {wq, bq, wk, bk, wv, bv, wo, bo} (no b* with bias=False); x (B, T, D) -> (B, T, D).
    impl "blockwise" runs blockwise_attention with query and key blocks of ``block``;
    "pallas" pallas_attention with blocks of block_q, block_k (0: the device's);
    "cudnn" cudnn_attention. With a ``key`` (full, blockwise) the probabilities go
    through dropout at ``dropout_rate`` (dropout.py)."""
    if impl == "blockwise":
        return blockwise_attention(p, x, n_heads, causal, block, compute_dtype, dropout_rate, key)
    if impl == "pallas":
        return pallas_attention(p, x, n_heads, causal, block_q, block_k, compute_dtype)
    if impl == "cudnn":
        return cudnn_attention(p, x, n_heads, causal, compute_dtype)
    cd = compute_dtype
    q, k, v = qkv_heads(p, x, n_heads, cd)  # (B, H, T, Dh) each
    probs = dropout(attention_probs(q, k, causal, cd), dropout_rate, key)  # (B, H, T, T)
    return linear(merge_heads(matmul(probs, v, cd)), p["wo"], p.get("bo"), cd)


def blockwise_attention(p, x, n_heads, causal, block, compute_dtype=None, dropout_rate=0.0, key=None):
    """attention(p, x, n_heads, causal) without the (B, H, T, T) probabilities: an online
    softmax over key blocks of ``block`` positions (jaxformer/blockwise.py). Every product,
    the projections' and the blocks', runs in ``compute_dtype``."""
    cd = compute_dtype
    q, k, v = qkv_heads(p, x, n_heads, cd)  # (B, H, T, Dh) each
    out, _ = blockwise_attention_core(q, k, v, causal, block, cd, dropout_rate, key)  # (B, H, T, Dh)
    return linear(merge_heads(out), p["wo"], p.get("bo"), cd)


def pallas_attention(p, x, n_heads, causal, block_q=0, block_k=0, compute_dtype=None):
    """attention(p, x, n_heads, causal) with the core softmax(q k^T / sqrt(Dh)) v as one
    Pallas kernel (pallas_attention.py) whose derivative is the hand-written backward
    kernels (pallas_backward.py); the projections are the linear layers above."""
    cd = compute_dtype
    q, k, v = qkv_heads(p, x, n_heads, cd)  # (B, H, T, Dh) each
    out = flash_attention(q, k, v, causal, block_q, block_k, cd)  # (B, H, T, Dh)
    return linear(merge_heads(out), p["wo"], p.get("bo"), cd)


CUDNN_DTYPES = ("bfloat16", "float16")


def check_cudnn(products_dtype) -> None:
    """Raise ValueError where cuDNN's fused attention cannot run: off a GPU, or with
    products in a dtype other than bfloat16 / float16."""
    backend = jax.default_backend()
    if backend != "gpu":
        raise ValueError(f"attention_impl 'cudnn' runs only on a GPU (cuDNN's fused attention); "
                         f"the backend is {backend!r}: use 'pallas', 'blockwise' or 'full'")
    if jnp.dtype(products_dtype).name not in CUDNN_DTYPES:
        raise ValueError(f"attention_impl 'cudnn' needs bfloat16 or float16 products, not "
                         f"{jnp.dtype(products_dtype).name}: set compute_dtype='bfloat16'")


def cudnn_attention(p, x, n_heads, causal, compute_dtype=None):
    """attention(p, x, n_heads, causal) with the core from jax.nn.dot_product_attention's
    cuDNN implementation (GPU only, bfloat16 or float16 products; JAX's grad only)."""
    cd = compute_dtype
    q, k, v = qkv_heads(p, x, n_heads, cd)  # (B, H, T, Dh) each
    dtype = jnp.dtype(cd or q.dtype)
    check_cudnn(dtype)
    q, k, v = (jnp.swapaxes(a, 1, 2).astype(dtype) for a in (q, k, v))  # (B, T, H, Dh), cuDNN's layout
    out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")  # (B, T, H, Dh)
    B, T = x.shape[:2]
    return linear(out.reshape(B, T, -1), p["wo"], p.get("bo"), cd)
