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

# ----------------------------------------------------------------------------
# precision policy: matmul inputs in the compute dtype, everything else in float32 or wider


def stats_dtype(dtype):
    """The dtype of statistics (layer norm, softmax, log-sum-exp, cross entropy) and of
    matmul accumulation: float32, or the input's dtype when wider (float64 stays float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def upcast(x):
    """x in stats_dtype(x.dtype): a no-op for float32 and float64."""
    return x.astype(stats_dtype(x.dtype))


def cast(x, compute_dtype):
    """x in the compute dtype (a ModelConfig.compute_dtype); None leaves x as it is."""
    return x if compute_dtype is None else x.astype(compute_dtype)


def matmul(a, b, compute_dtype=None):
    """a @ b with both inputs cast to ``compute_dtype`` and the product accumulated and
    returned in stats_dtype of the inputs' own dtype (float32 for float32 or bfloat16
    inputs). None, or a compute dtype equal to the inputs', is plain ``a @ b``."""
    out = jnp.result_type(a, b)
    if compute_dtype is None or (jnp.dtype(compute_dtype) == out == a.dtype == b.dtype):
        return a @ b
    return jnp.matmul(a.astype(compute_dtype), b.astype(compute_dtype),
                      preferred_element_type=stats_dtype(out))


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
    softmax over key blocks of ``block`` positions (jaxformer/blockwise.py). The
    projections' products run in ``compute_dtype``; the blocks in their output dtype."""
    cd = compute_dtype
    q, k, v = qkv_heads(p, x, n_heads, cd)  # (B, H, T, Dh) each
    out, _ = blockwise_attention_core(q, k, v, causal, block)  # (B, H, T, Dh)
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


# ----------------------------------------------------------------------------
# key/value cache for decoding (the same pieces as above, on a cache of S slots)


def masked_softmax(scores, mask):
    """softmax over the last axis of scores (..., Tk) where mask (broadcast) is True; as in
    attention_probs, masked scores get the dtype's minimum and the row max is subtracted."""
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    scores = scores - jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.exp(scores)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def attention_cached(p, x, cache_k, cache_v, start, n_heads):
    """Causal attention of t new tokens at cache slots [start, start + t) over the cache.

    x (B, t, D); cache_k, cache_v (B, H, S, Dh); start int32 scalar. The new keys and
    values are written into their slots, then query i attends to slots <= start + i.
    Returns out (B, t, D) and the updated cache_k, cache_v.
    """
    q, k, v = qkv_heads(p, x, n_heads)  # (B, H, t, Dh) each
    zero, start = jnp.int32(0), jnp.asarray(start, jnp.int32)
    at = (zero, zero, start, zero)
    cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), at)
    cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), at)
    scores = (q @ jnp.swapaxes(cache_k, -1, -2)) / math.sqrt(q.shape[-1])  # (B, H, t, S)
    t, S = x.shape[1], cache_k.shape[2]
    mask = jnp.arange(S)[None, :] <= start + jnp.arange(t)[:, None]  # (t, S)
    probs = masked_softmax(scores, mask)  # (B, H, t, S)
    return linear(merge_heads(probs @ cache_v), p["wo"], p["bo"]), cache_k, cache_v


def block_cached(p, x, cache_k, cache_v, start, config: ModelConfig):
    """``block`` for t new tokens at cache slots [start, start + t): x (B, t, D);
    cache_k, cache_v (B, H, S, Dh) of this layer. Returns (x, cache_k, cache_v)."""
    eps, H, act = config.ln_eps, config.n_heads, config.activation
    if config.norm == "pre":
        a, cache_k, cache_v = attention_cached(p["attn"], layer_norm(p["ln1"], x, eps),
                                               cache_k, cache_v, start, H)
        x = x + a
        x = x + feed_forward(p["ffn"], layer_norm(p["ln2"], x, eps), act)
    else:
        a, cache_k, cache_v = attention_cached(p["attn"], x, cache_k, cache_v, start, H)
        x = layer_norm(p["ln1"], x + a, eps)
        x = layer_norm(p["ln2"], x + feed_forward(p["ffn"], x, act), eps)
    return x, cache_k, cache_v


def embed_at(params, inputs, start, config: ModelConfig):
    """``embed`` of inputs int (B, t) at positions [start, start + t) (start may be traced)."""
    x = token_embedding(params["tok_embed"], inputs)  # (B, t, D)
    t, D = inputs.shape[-1], config.d_model
    if config.positions == "learned":
        table = params["pos_embed"]  # (max_seq_len, D)
    else:
        table = sinusoidal_positions(config.max_seq_len, D, x.dtype)
    return x + jax.lax.dynamic_slice(table, (jnp.asarray(start, jnp.int32), jnp.int32(0)), (t, D))
