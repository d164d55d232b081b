"""The model's forward over a key/value cache, for decoding.

The cache holds, per layer, the keys and values of the tokens seen so far in S =
max_seq_len slots: ``{"k": (L, B, H, S, Dh), "v": (L, B, H, S, Dh)}``. The token in
slot j has position j (so learned positions stay within the table the model was
trained on). ``forward_cached`` runs t new tokens at slots [start, start + t) and
writes their keys and values; a prefill is t = S at start 0 (padding past the
prompt is harmless: later slots are masked, and decoding overwrites them).

The block is block.py's ``compose_block`` with ``attention_cached`` as its attention
(the same fused q|k|v product ``qkv_heads`` as training, then the scores against the
whole cache); the other pieces are the model's, under the same precision policy: every
product runs in config.compute_dtype through ``matmul`` / ``linear``, the softmax in
float32 or wider.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.model.attention import attention_scores, masked_softmax, merge_heads, qkv_heads
from jaxformer.model.block import BLOCK_LAYERS, compose_block
from jaxformer.model.config import ModelConfig
from jaxformer.model.embedding import sinusoidal_positions, token_embedding
from jaxformer.model.layer_norm import layer_norm
from jaxformer.model.linear import linear
from jaxformer.model.params import head_weights
from jaxformer.model.precision import matmul, upcast


def init_cache(config: ModelConfig, batch: int, dtype) -> dict:
    """An empty cache: {"k", "v"} each (L, B, H, S, Dh) zeros."""
    shape = (config.n_layers, batch, config.n_heads, config.max_seq_len, config.d_head)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def attention_cached(p, x, cache_k, cache_v, start, n_heads, compute_dtype=None):
    """Causal attention of t new tokens at cache slots [start, start + t) over the cache.

    x (B, t, D); cache_k, cache_v (B, H, S, Dh); start int32 scalar. The new keys and
    values are written into their slots, then query i attends to slots <= start + i.
    Returns out (B, t, D) and the updated cache_k, cache_v. Products in ``compute_dtype``.
    """
    cd = compute_dtype
    q, k, v = qkv_heads(p, x, n_heads, cd)  # (B, H, t, Dh) each: one product x @ [wq | wk | wv]
    zero, start = jnp.int32(0), jnp.asarray(start, jnp.int32)
    at = (zero, zero, start, zero)
    cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), at)
    cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), at)
    scores = attention_scores(q, cache_k, cd)  # (B, H, t, S)
    t, S = x.shape[1], cache_k.shape[2]
    mask = jnp.arange(S)[None, :] <= start + jnp.arange(t)[:, None]  # (t, S)
    probs = masked_softmax(scores, mask)  # (B, H, t, S)
    out = linear(merge_heads(matmul(probs, cache_v, cd)), p["wo"], p.get("bo"), cd)  # (B, t, D)
    return out, cache_k, cache_v


def block_cached(p, x, cache_k, cache_v, start, config: ModelConfig):
    """block.block for t new tokens at cache slots [start, start + t): x (B, t, D);
    cache_k, cache_v (B, H, S, Dh) of this layer. Returns (x, cache_k, cache_v).
    The block's own composition, with attention_cached as its attention."""

    def attend(pa, h, config):  # (y, the updated cache): compose_block hands it back
        y, k, v = attention_cached(pa, h, cache_k, cache_v, start, config.n_heads,
                                   config.compute_dtype)
        return y, (k, v)

    x, (cache_k, cache_v) = compose_block(p, x, config, BLOCK_LAYERS._replace(attention=attend))
    return x, cache_k, cache_v


def embed_at(params, inputs, start, config: ModelConfig):
    """embedding.embed of inputs int (B, t) at positions [start, start + t) (start may be traced)."""
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
    logits = linear(x, *head_weights(params, config), config.compute_dtype)  # (B, t, V)
    return logits, {"k": k, "v": v}
