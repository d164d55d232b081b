"""The forward of each layer, as pure functions over its slice of the params.

Shape letters, used everywhere: B batch, T time, D d_model, H heads,
Dh = D // H head width, F d_ff, V vocab, L layers.

These functions are the single definition of the forward math. The manual
backward passes in ``manual_grads/`` call the small pieces below
(``layer_norm_stats``, ``split_heads``, ``attention_probs``, ...) to recompute
nothing and keep exactly what their backward needs.

Precision (``ModelConfig.compute_dtype``): every product goes through ``matmul``,
which casts its inputs to the compute dtype and accumulates in float32 or wider;
statistics go through ``upcast``. docs/design.md, "Mixed precision", has the table.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxformer.blockwise import blockwise_attention_core
from jaxformer.config import ModelConfig
from jaxformer.precision import cast, matmul, stats_dtype, upcast  # noqa: F401 - re-exported


# ----------------------------------------------------------------------------
# linear and activations


def linear(x, w, b, compute_dtype=None):
    """x @ w + b over any leading dims: x (..., I), w (I, O), b (O,) -> (..., O).
    The product runs in ``compute_dtype`` (see ``matmul``); the bias adds in float32."""
    return matmul(x, w, compute_dtype) + b


def gelu(x):
    """GELU, exact: x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt(2)))."""
    return 0.5 * x * (1.0 + jax.lax.erf(x / math.sqrt(2.0)))


GELU_TANH_C = math.sqrt(2.0 / math.pi)
GELU_TANH_A = 0.044715  # the cubic coefficient of the tanh approximation


def gelu_tanh(x):
    """GELU, tanh approximation: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + jnp.tanh(GELU_TANH_C * (x + GELU_TANH_A * x**3)))


def relu(x):
    return jnp.maximum(x, 0)


def tanh(x):
    return jnp.tanh(x)


ACTIVATION_FNS = {"gelu": gelu, "gelu_tanh": gelu_tanh, "relu": relu, "tanh": tanh}


def activation(name: str, x):
    return ACTIVATION_FNS[name](x)


# ----------------------------------------------------------------------------
# layer norm


def row_scale(x):
    """(..., 1) power of two s with max|x * s| in [0.5, 1) for rows whose max |x| is at
    least 1, and s = 1 otherwise. Multiplying by a power of two is exact, and s carries
    no gradient: it only keeps the statistics below away from overflow and underflow."""
    _, exponent = jnp.frexp(jnp.max(jnp.abs(x), axis=-1, keepdims=True))
    exponent = jnp.where(jnp.isfinite(x).all(axis=-1, keepdims=True), exponent, 0)
    return jax.lax.stop_gradient(jnp.ldexp(jnp.ones((), x.dtype), -jnp.maximum(exponent, 0)))


def layer_norm_stats(x, eps):
    """Normalize over the last axis: x (..., D) -> xhat (..., D), rstd (..., 1), both in
    float32 or wider (``upcast``).

    Computed on xs = x * s, s = row_scale(x): var(x) + eps = (var(xs) + eps s^2) / s^2,
    so xhat = (xs - mean(xs)) * rsqrt(var(xs) + eps s^2) and rstd = s * rsqrt(...). The
    statistics of xs are O(1), so neither the squares in the forward nor the
    (var + eps)^(-3/2) that JAX's grad forms in the backward leave the float range."""
    x = upcast(x)
    s = row_scale(x)  # (..., 1)
    xs = x * s
    xc = xs - jnp.mean(xs, axis=-1, keepdims=True)
    var = jnp.mean(xc * xc, axis=-1, keepdims=True)
    r = jax.lax.rsqrt(var + eps * s * s)  # (..., 1): 1 / sqrt(var(xs) + eps s^2)
    return xc * r, s * r


def layer_norm(p, x, eps):
    """p = {"scale": (D,), "bias": (D,)}; x (..., D) -> (..., D)."""
    xhat, _ = layer_norm_stats(x, eps)
    return xhat * p["scale"] + p["bias"]


# ----------------------------------------------------------------------------
# multi-head attention


def split_heads(x, n_heads):
    """(B, T, D) -> (B, H, T, Dh): head h takes features h*Dh:(h+1)*Dh."""
    B, T, D = x.shape
    return x.reshape(B, T, n_heads, D // n_heads).transpose(0, 2, 1, 3)


def merge_heads(x):
    """(B, H, T, Dh) -> (B, T, D), the inverse of split_heads."""
    B, H, T, Dh = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * Dh)


def qkv_weights(p):
    """The three input projections side by side: w = [wq | wk | wv] (D, 3D), b (3D,)."""
    return (jnp.concatenate([p["wq"], p["wk"], p["wv"]], axis=1),
            jnp.concatenate([p["bq"], p["bk"], p["bv"]]))


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


def attention_probs(q, k, causal, compute_dtype=None):
    """q, k (B, H, T, Dh) -> softmax(q k^T / sqrt(Dh)) (B, H, T, T), future masked if causal.
    q k^T runs in ``compute_dtype``; the softmax in float32 or wider."""
    scores = upcast(matmul(q, jnp.swapaxes(k, -1, -2), compute_dtype)) / math.sqrt(q.shape[-1])
    if causal:
        T = q.shape[-2]
        scores = jnp.where(causal_mask(T), scores, jnp.finfo(scores.dtype).min)
    scores = scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    e = jnp.exp(scores)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def attention(p, x, n_heads, causal, compute_dtype=None, impl="full", block=128):
    """p = {wq, bq, wk, bk, wv, bv, wo, bo}; x (B, T, D) -> (B, T, D).
    impl "blockwise" runs blockwise_attention with query and key blocks of ``block``."""
    if impl == "blockwise":
        return blockwise_attention(p, x, n_heads, causal, block, compute_dtype)
    cd = compute_dtype
    q, k, v = qkv_heads(p, x, n_heads, cd)  # (B, H, T, Dh) each
    probs = attention_probs(q, k, causal, cd)  # (B, H, T, T)
    return linear(merge_heads(matmul(probs, v, cd)), p["wo"], p["bo"], cd)


def blockwise_attention(p, x, n_heads, causal, block, compute_dtype=None):
    """attention(p, x, n_heads, causal) without the (B, H, T, T) probabilities: an online
    softmax over key blocks of ``block`` positions (jaxformer/blockwise.py). Every product,
    the projections' and the blocks', runs in ``compute_dtype``."""
    cd = compute_dtype
    q, k, v = qkv_heads(p, x, n_heads, cd)  # (B, H, T, Dh) each
    out, _ = blockwise_attention_core(q, k, v, causal, block, cd)  # (B, H, T, Dh)
    return linear(merge_heads(out), p["wo"], p["bo"], cd)


# ----------------------------------------------------------------------------
# feed-forward


def feed_forward(p, x, activation_name, compute_dtype=None):
    """p = {w_in (D, F), b_in (F,), w_out (F, D), b_out (D,)}; x (..., D) -> (..., D)."""
    h = linear(x, p["w_in"], p["b_in"], compute_dtype)
    return linear(activation(activation_name, h), p["w_out"], p["b_out"], compute_dtype)


# ----------------------------------------------------------------------------
# embeddings


def sinusoidal_positions(T, D, dtype=jnp.float32):
    """(T, D) table: sin(t / 10000^(2i/D)) at feature 2i, cos(...) at feature 2i+1."""
    t = jnp.arange(T, dtype=jnp.promote_types(dtype, jnp.float32))[:, None]
    i = jnp.arange(0, D, 2, dtype=t.dtype)[None, :]
    angle = t / (10000.0 ** (i / D))  # (T, ceil(D/2))
    table = jnp.zeros((T, D), t.dtype)
    table = table.at[:, 0::2].set(jnp.sin(angle))
    table = table.at[:, 1::2].set(jnp.cos(angle[:, : D // 2]))
    return table.astype(dtype)


def positions(params, T, config: ModelConfig, dtype):
    """The (T, D) position term added to the token embeddings."""
    if config.positions == "learned":
        return params["pos_embed"][:T]
    return sinusoidal_positions(T, config.d_model, dtype)


def token_embedding(table, ids):
    """table (V, D), ids int (...) -> the rows table[ids] (..., D)."""
    return jnp.take(table, ids, axis=0)


def embed(params, inputs, config: ModelConfig):
    """inputs int (B, T) -> tok_embed[inputs] + positions (B, T, D)."""
    x = token_embedding(params["tok_embed"], inputs)
    return x + positions(params, inputs.shape[-1], config, x.dtype)


# ----------------------------------------------------------------------------
# the residual block


def block(p, x, config: ModelConfig):
    """One transformer block. p is one layer's slice of params["blocks"]; x (B, T, D)."""
    eps, H, causal, act = config.ln_eps, config.n_heads, config.causal, config.activation
    cd = config.compute_dtype
    impl = dict(impl=config.attention_impl, block=config.attention_block)
    if config.norm == "pre":
        x = x + attention(p["attn"], layer_norm(p["ln1"], x, eps), H, causal, cd, **impl)
        x = x + feed_forward(p["ffn"], layer_norm(p["ln2"], x, eps), act, cd)
    else:
        x = layer_norm(p["ln1"], x + attention(p["attn"], x, H, causal, cd, **impl), eps)
        x = layer_norm(p["ln2"], x + feed_forward(p["ffn"], x, act, cd), eps)
    return x
