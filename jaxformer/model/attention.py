"""Multi-head attention: full (the (B, H, T, T) probabilities), blockwise (a lax loop
over blocks), pallas (the same online softmax as one Pallas kernel) or cudnn (cuDNN's).

Head h of attention uses columns h*Dh:(h+1)*Dh of wq/wk/wv (Dh = D // H); q, k and v
come out of one product x @ [wq | wk | wv]; scores are scaled by 1/sqrt(Dh).

The modern block's options act on q and k between the projections and the core
(``rotate_qk``): QK-norm (an RMS norm over each head's q and k, params q_norm and k_norm),
then rotary positions (rotary.py). Grouped-query attention (n_kv_heads < n_heads) gives k
and v Hkv = n_kv_heads heads, wk and wv (D, Hkv * Dh); query head h reads key/value head
h // G, G = H // Hkv (Hugging Face's ``repeat_kv``). The full and blockwise cores see k and
v repeated G times (``repeat_kv``); the Pallas kernel and cuDNN read the Hkv heads as they are."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxformer.model.blockwise import blockwise_attention_core
from jaxformer.model.dropout import dropout
from jaxformer.model.linear import linear
from jaxformer.kernels.pallas import flash_attention
from jaxformer.model.precision import matmul, upcast
from jaxformer.kernels.refused import refused
from jaxformer.model.rms_norm import rms_norm
from jaxformer.model.rotary import apply_rope, rope_tables


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


def split_qkv(qkv, n_heads, n_kv_heads=0):
    """(B, T, (H + 2 Hkv) Dh) -> q (B, H, T, Dh), k, v (B, Hkv, T, Dh) (n_kv_heads 0: Hkv = H,
    in one transpose): columns [0, H Dh) are q, then k's and v's Hkv Dh each, and head h of
    each takes its features h*Dh:(h+1)*Dh."""
    B, T, W = qkv.shape
    Hkv = n_kv_heads or n_heads
    Dh = W // (n_heads + 2 * Hkv)
    if Hkv == n_heads:
        qkv = qkv.reshape(B, T, 3, n_heads, Dh).transpose(2, 0, 3, 1, 4)
        return qkv[0], qkv[1], qkv[2]  # (B, H, T, Dh) each
    q, k, v = jnp.split(qkv, [n_heads * Dh, (n_heads + Hkv) * Dh], axis=-1)
    return split_heads(q, n_heads), split_heads(k, Hkv), split_heads(v, Hkv)


def merge_qkv(q, k, v):
    """q (B, H, T, Dh), k, v (B, Hkv, T, Dh) -> (B, T, (H + 2 Hkv) Dh), the inverse of split_qkv."""
    B, H, T, Dh = q.shape
    if k.shape[1] != H:
        return jnp.concatenate([merge_heads(q), merge_heads(k), merge_heads(v)], axis=-1)
    return jnp.stack([q, k, v]).transpose(1, 3, 0, 2, 4).reshape(B, T, 3 * H * Dh)


def qkv_heads(p, x, n_heads, compute_dtype=None, n_kv_heads=0):
    """x (B, T, D) -> q (B, H, T, Dh), k, v (B, Hkv, T, Dh): one product x @ [wq | wk | wv] + [bq | bk | bv]."""
    w, b = qkv_weights(p)
    return split_qkv(linear(x, w, b, compute_dtype), n_heads, n_kv_heads)


def repeat_kv(x, groups):
    """(B, Hkv, T, Dh) -> (B, Hkv * G, T, Dh): head h of the result is head h // G of x."""
    return x if groups == 1 else jnp.repeat(x, groups, axis=1)


def rotate_qk(p, q, k, norm_eps, rope_theta, start=0):
    """QK-norm then rotary positions on q (B, H, T, Dh) and k (B, Hkv, T, Dh): an RMS norm
    over each head's width where p has q_norm (and k_norm); rope_theta > 0 rotates position
    start + t. Neither option: q and k as they are."""
    if "q_norm" in p:
        q, k = rms_norm(p["q_norm"], q, norm_eps), rms_norm(p["k_norm"], k, norm_eps)
    if rope_theta:
        cos, sin = rope_tables(start + jnp.arange(q.shape[-2]), q.shape[-1], rope_theta, q.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (T, Dh) tables
    return q, k


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
    """The keyword arguments of ``attention`` a ModelConfig sets: impl, block sizes, dropout,
    key/value heads, QK-norm's eps and the rotary base (0: no rotary positions)."""
    return dict(impl=config.attention_impl, block=config.attention_block,
                block_q=config.pallas_block_q, block_k=config.pallas_block_k,
                dropout_rate=config.dropout, n_kv_heads=config.kv_heads, norm_eps=config.ln_eps,
                rope_theta=config.rope_theta if config.positions == "rope" else 0.0)


def attention_qkv(p, x, n_heads, compute_dtype=None, n_kv_heads=0, norm_eps=1e-5, rope_theta=0.0):
    """x (B, T, D) -> q (B, H, T, Dh), k, v (B, Hkv, T, Dh) as the core reads them: the
    projections, then QK-norm and rotary positions (``rotate_qk``) where they are on."""
    q, k, v = qkv_heads(p, x, n_heads, compute_dtype, n_kv_heads)
    q, k = rotate_qk(p, q, k, norm_eps, rope_theta)
    return q, k, v


def attention(p, x, n_heads, causal, compute_dtype=None, impl="full", block=128, block_q=0, block_k=0,
              dropout_rate=0.0, key=None, n_kv_heads=0, norm_eps=1e-5, rope_theta=0.0):
    """p = {wq, bq, wk, bk, wv, bv, wo, bo, q_norm?, k_norm?} (no b* with bias=False);
    x (B, T, D) -> (B, T, D). impl "blockwise" runs blockwise_attention with query and key
    blocks of ``block``; "pallas" pallas_attention with blocks of block_q, block_k (0: the
    device's); "cudnn" cudnn_attention. With a ``key`` (full, blockwise) the probabilities go
    through dropout at ``dropout_rate`` (dropout.py). n_kv_heads, norm_eps, rope_theta: the
    modern block's (``attention_qkv``)."""
    qkv = dict(n_kv_heads=n_kv_heads, norm_eps=norm_eps, rope_theta=rope_theta)
    if impl == "blockwise":
        return blockwise_attention(p, x, n_heads, causal, block, compute_dtype, dropout_rate, key, **qkv)
    if impl == "pallas":
        return pallas_attention(p, x, n_heads, causal, block_q, block_k, compute_dtype, **qkv)
    if impl == "cudnn":
        return cudnn_attention(p, x, n_heads, causal, compute_dtype, **qkv)
    cd = compute_dtype
    q, k, v = attention_qkv(p, x, n_heads, cd, **qkv)  # q (B, H, T, Dh), k, v (B, Hkv, T, Dh)
    G = n_heads // k.shape[1]
    probs = dropout(attention_probs(q, repeat_kv(k, G), causal, cd), dropout_rate, key)  # (B, H, T, T)
    return linear(merge_heads(matmul(probs, repeat_kv(v, G), cd)), p["wo"], p.get("bo"), cd)


def blockwise_attention(p, x, n_heads, causal, block, compute_dtype=None, dropout_rate=0.0, key=None,
                        n_kv_heads=0, norm_eps=1e-5, rope_theta=0.0):
    """attention(p, x, n_heads, causal) without the (B, H, T, T) probabilities: an online
    softmax over key blocks of ``block`` positions (jaxformer/blockwise.py). Every product,
    the projections' and the blocks', runs in ``compute_dtype``."""
    cd = compute_dtype
    q, k, v = attention_qkv(p, x, n_heads, cd, n_kv_heads, norm_eps, rope_theta)
    G = n_heads // k.shape[1]
    out, _ = blockwise_attention_core(q, repeat_kv(k, G), repeat_kv(v, G), causal, block, cd,
                                      dropout_rate, key)  # (B, H, T, Dh)
    return linear(merge_heads(out), p["wo"], p.get("bo"), cd)


def pallas_attention(p, x, n_heads, causal, block_q=0, block_k=0, compute_dtype=None,
                     n_kv_heads=0, norm_eps=1e-5, rope_theta=0.0):
    """attention(p, x, n_heads, causal) with the core softmax(q k^T / sqrt(Dh)) v as one
    Pallas kernel (pallas_attention.py) whose derivative is the hand-written backward
    kernels (pallas_backward.py); the projections are the linear layers above. The kernel
    reads k and v with their Hkv heads (grouped-query attention without repeats)."""
    cd = compute_dtype
    q, k, v = attention_qkv(p, x, n_heads, cd, n_kv_heads, norm_eps, rope_theta)
    out = flash_attention(q, k, v, causal, block_q, block_k, cd)  # (B, H, T, Dh)
    return linear(merge_heads(out), p["wo"], p.get("bo"), cd)


CUDNN_DTYPES = ("bfloat16", "float16")


def check_cudnn(products_dtype) -> None:
    """Raise ValueError where cuDNN's fused attention cannot take the products: a dtype
    other than bfloat16 / float16. The device is not checked here: the program runs cuDNN
    where it is lowered for cuda (``cudnn_core``), so a CPU process may export it."""
    if jnp.dtype(products_dtype).name not in CUDNN_DTYPES:
        raise ValueError(f"attention_impl 'cudnn' needs bfloat16 or float16 products, not "
                         f"{jnp.dtype(products_dtype).name}: set compute_dtype='bfloat16'")


def cudnn_attention(p, x, n_heads, causal, compute_dtype=None, n_kv_heads=0, norm_eps=1e-5,
                    rope_theta=0.0):
    """attention(p, x, n_heads, causal) with the core from jax.nn.dot_product_attention's
    cuDNN implementation (lowered for cuda only, bfloat16 or float16 products; JAX's grad
    only); it reads k and v with their Hkv heads."""
    cd = compute_dtype
    q, k, v = attention_qkv(p, x, n_heads, cd, n_kv_heads, norm_eps, rope_theta)
    dtype = jnp.dtype(cd or q.dtype)
    check_cudnn(dtype)
    q, k, v = (jnp.swapaxes(a, 1, 2).astype(dtype) for a in (q, k, v))  # (B, T, H, Dh), cuDNN's layout
    out = cudnn_core(q, k, v, causal)  # (B, T, H, Dh)
    B, T = x.shape[:2]
    return linear(out.reshape(B, T, -1), p["wo"], p.get("bo"), cd)


OFF_GPU = ("attention_impl 'cudnn' runs only on a GPU (cuDNN's fused attention); the program "
           "is lowered for {platform}: use 'pallas', 'blockwise' or 'full'")


def cudnn_core(q, k, v, causal):
    """q (B, T, H, Dh), k, v (B, T, Hkv, Dh) -> (B, T, H, Dh): cuDNN's attention where the
    program is lowered for cuda; lowered for any other platform (or run off a GPU), a
    ValueError naming it. Both branches are traced, so a CPU process can export the cuda
    program; JAX's cuDNN wrapper asks the CUDA plugin for cuDNN's version while tracing,
    and a process without the plugin gets that error at the cuda lowering, not before."""
    def on_cuda(q, k, v):
        try:
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
        except (RuntimeError, NotImplementedError) as error:  # no CUDA plugin here; a shape cuDNN refuses
            hint = (" (JAX reads cuDNN's version from its CUDA plugin while tracing: pip install "
                    "'jaxformer[cuda]')") if isinstance(error, RuntimeError) else ""
            return _refused(q, f"attention_impl 'cudnn' cannot be lowered for cuda here: {error}{hint}")

    return jax.lax.platform_dependent(q, k, v, cuda=on_cuda, default=lambda q, k, v: _refused(q, OFF_GPU))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _refused(like, message: str):
    """refused.refused of ``like``'s shape and dtype (ValueError), differentiable: its
    cotangent is another such stand-in, so jax.grad traces the cuda program's other branch."""
    return refused(like, ValueError, message)


_refused.defvjp(lambda like, message: (_refused(like, message), None),
                lambda message, _, g: (_refused(g, message),))
