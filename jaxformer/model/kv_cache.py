"""The model's forward over a key/value cache, for decoding.

The cache holds, per layer, the keys and values of the tokens seen so far in S =
max_seq_len slots: ``{"k": (L, B, H, S, Dh), "v": (L, B, H, S, Dh)}``. The token in
slot j has position j (so learned positions stay within the table the model was
trained on). ``forward_cached`` runs t new tokens at slots [start, start + t) and
writes their keys and values; a prefill is t = S at start 0 (padding past the
prompt is harmless: later slots are masked, and decoding overwrites them).

The pieces are layers.py's, under the same precision policy: every product runs in
config.compute_dtype through ``matmul`` / ``linear``, the softmax in float32 or wider.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxformer.model.config import ModelConfig
from jaxformer.model.attention import merge_heads, split_heads
from jaxformer.model.block import feed_forward
from jaxformer.model.embedding import sinusoidal_positions, token_embedding
from jaxformer.model.layer_norm import layer_norm
from jaxformer.model.linear import linear
from jaxformer.model.precision import matmul, upcast


def init_cache(config: ModelConfig, batch: int, dtype) -> dict:
    """An empty cache: {"k", "v"} each (L, B, H, S, Dh) zeros."""
    shape = (config.n_layers, batch, config.n_heads, config.max_seq_len, config.d_head)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def masked_softmax(scores, mask):
    """softmax over the last axis of scores (..., Tk) where mask (broadcast) is True; as in
    layers.attention_probs, masked scores get the dtype's minimum and the row max is subtracted."""
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    scores = scores - jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.exp(scores)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def attention_cached(p, x, cache_k, cache_v, start, n_heads, compute_dtype=None):
    """Causal attention of t new tokens at cache slots [start, start + t) over the cache.

    x (B, t, D); cache_k, cache_v (B, H, S, Dh); start int32 scalar. The new keys and
    values are written into their slots, then query i attends to slots <= start + i.
    Returns out (B, t, D) and the updated cache_k, cache_v. Products in ``compute_dtype``.
    """
    cd = compute_dtype
    q = split_heads(linear(x, p["wq"], p["bq"], cd), n_heads)  # (B, H, t, Dh)
    k = split_heads(linear(x, p["wk"], p["bk"], cd), n_heads)  # (B, H, t, Dh)
    v = split_heads(linear(x, p["wv"], p["bv"], cd), n_heads)  # (B, H, t, Dh)
    zero, start = jnp.int32(0), jnp.asarray(start, jnp.int32)
    at = (zero, zero, start, zero)
    cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), at)
    cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), at)
    scores = upcast(matmul(q, jnp.swapaxes(cache_k, -1, -2), cd)) / math.sqrt(q.shape[-1])  # (B, H, t, S)
    t, S = x.shape[1], cache_k.shape[2]
    mask = jnp.arange(S)[None, :] <= start + jnp.arange(t)[:, None]  # (t, S)
    probs = masked_softmax(scores, mask)  # (B, H, t, S)
    out = linear(merge_heads(matmul(probs, cache_v, cd)), p["wo"], p["bo"], cd)  # (B, t, D)
    return out, cache_k, cache_v


def block_cached(p, x, cache_k, cache_v, start, config: ModelConfig):
    """layers.block for t new tokens at cache slots [start, start + t): x (B, t, D);
    cache_k, cache_v (B, H, S, Dh) of this layer. Returns (x, cache_k, cache_v)."""
    eps, H, act, cd = config.ln_eps, config.n_heads, config.activation, config.compute_dtype
    if config.norm == "pre":
        a, cache_k, cache_v = attention_cached(p["attn"], layer_norm(p["ln1"], x, eps),
                                               cache_k, cache_v, start, H, cd)
        x = x + a
        x = x + feed_forward(p["ffn"], layer_norm(p["ln2"], x, eps), act, cd)
    else:
        a, cache_k, cache_v = attention_cached(p["attn"], x, cache_k, cache_v, start, H, cd)
        x = layer_norm(p["ln1"], x + a, eps)
        x = layer_norm(p["ln2"], x + feed_forward(p["ffn"], x, act, cd), eps)
    return x, cache_k, cache_v


def embed_at(params, inputs, start, config: ModelConfig):
    """layers.embed of inputs int (B, t) at positions [start, start + t) (start may be traced)."""
    x = token_embedding(params["tok_embed"], inputs)  # (B, t, D)
    t, D = inputs.shape[-1], config.d_model
    if config.positions == "learned":
        table = params["pos_embed"]  # (max_seq_len, D)
    else:
        table = sinusoidal_positions(config.max_seq_len, D, x.dtype)
    return x + jax.lax.dynamic_slice(table, (jnp.asarray(start, jnp.int32), jnp.int32(0)), (t, D))


def forward_cached(params, inputs, cache, start, config: ModelConfig):
    """inputs int (B, t) at slots [start, start + t) -> (logits (B, t, V), updated cache)."""
    x = upcast(embed_at(params, inputs, start, config))  # (B, t, D), float32 or wider, as in features

    def layer(x, layer_in):
        p, k, v = layer_in
        x, k, v = block_cached(p, x, k, v, start, config)
        return x, (k, v)

    x, (k, v) = jax.lax.scan(layer, x, (params["blocks"], cache["k"], cache["v"]))
    if config.norm == "pre":
        x = layer_norm(params["ln_f"], x, config.ln_eps)
    logits = linear(x, params["head"]["w"], params["head"]["b"], config.compute_dtype)  # (B, t, V)
    return logits, {"k": k, "v": v}
