"""The model's forward over a key/value cache, for decoding.

The cache holds, per layer, the keys and values of the tokens seen so far in S =
max_seq_len slots: ``{"k": (L, B, Hkv, S, Dh), "v": (L, B, Hkv, S, Dh)}``, Hkv =
config.kv_heads (grouped-query attention keeps H / Hkv times fewer; the keys are kept
after QK-norm and rotary positions, as attention reads them). The token in
slot j has position j (so learned positions stay within the table the model was
trained on). ``forward_cached`` runs t new tokens at slots [start, start + t) and
writes their keys and values; a prefill is t = S at start 0 (padding past the
prompt is harmless: later slots are masked, and decoding overwrites them).

The block is block.py's ``compose_block`` with ``attention_cached`` as its attention
(the same ``attention_qkv`` as training, then the full core's probabilities against the
whole cache, ``attention_probs`` with the training spec's mask rule, a sliding window
included: query t reads slots t - W < s <= t only, layer by layer as config.layer_types
says); the other pieces are
the model's, under the same precision policy: every product runs in config.compute_dtype
through ``matmul`` / ``linear``, the softmax in float32 or wider.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxformer.model.attention import attention_out, attention_qkv, attention_spec
from jaxformer.model.cores import attention_probs, repeat_kv
from jaxformer.model.block import BLOCK_LAYERS, compose_block, pick_norm
from jaxformer.model.config import ModelConfig
from jaxformer.model.embedding import sinusoidal_positions, token_embedding, token_scale
from jaxformer.model.layer_kinds import per_layer
from jaxformer.model.linear import linear
from jaxformer.model.params import head_weights
from jaxformer.model.softcap import softcap
from jaxformer.model.precision import matmul, upcast

ROUND = 64  # cache and prefill lengths are multiples of this (nearby lengths share a compile)


def round_up(length: int) -> int:
    """``length`` rounded up to a multiple of ROUND (nearby lengths share a compile)."""
    return -(-int(length) // ROUND) * ROUND


def cache_config(config: ModelConfig, length: int) -> ModelConfig:
    """``config`` with max_seq_len cut to ``length`` rounded up to ROUND (never past the
    model's own): the cache's slots. Position j computes the same in a shorter cache (rotary
    and sinusoidal positions need no table; a learned table is the params' own, read at j)."""
    return config.replace(max_seq_len=min(config.max_seq_len, round_up(length)))


def init_cache(config: ModelConfig, batch: int, dtype) -> dict:
    """An empty cache: {"k", "v"} each (L, B, Hkv, S, Dh) zeros."""
    shape = (config.n_layers, batch, config.kv_heads, config.max_seq_len, config.d_head)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def attention_cached(p, x, cache_k, cache_v, start, config: ModelConfig):
    """Causal attention of t new tokens at cache slots [start, start + t) over the cache.

    x (B, t, D); cache_k, cache_v (B, Hkv, S, Dh); start int32 scalar. The new keys and
    values (after QK-norm and rotary positions at start + i) are written into their slots,
    then query i attends to slots <= start + i. Returns out (B, t, D) and the updated
    cache_k, cache_v. Products in config.compute_dtype.
    """
    cd = config.compute_dtype
    zero, start = jnp.int32(0), jnp.asarray(start, jnp.int32)
    q, k, v = attention_qkv(p, x, config, start)  # q (B, H, t, Dh), k, v (B, Hkv, t, Dh): one product
    at = (zero, zero, start, zero)
    cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), at)
    cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), at)
    G = config.n_heads // config.kv_heads
    spec = dataclasses.replace(attention_spec(config), causal=True)  # slots past start + i are empty
    probs = attention_probs(q, repeat_kv(cache_k, G), spec, start)  # (B, H, t, S)
    out = attention_out(p, matmul(probs, repeat_kv(cache_v, G), cd), cd)  # (B, t, D)
    return out, cache_k, cache_v


def block_cached(p, x, cache_k, cache_v, start, config: ModelConfig):
    """block.block for t new tokens at cache slots [start, start + t): x (B, t, D);
    cache_k, cache_v (B, Hkv, S, Dh) of this layer. Returns (x, cache_k, cache_v).
    The block's own composition, with attention_cached as its attention."""

    def attend(pa, h, config):  # (y, the updated cache): compose_block hands it back
        y, k, v = attention_cached(pa, h, cache_k, cache_v, start, config)
        return y, (k, v)

    x, aux = compose_block(p, x, config, BLOCK_LAYERS._replace(attention=attend))
    cache_k, cache_v = aux[0] if config.n_experts else aux  # MoE: (the cache, the router's statistics)
    return x, cache_k, cache_v


def embed_at(params, inputs, start, config: ModelConfig):
    """embedding.embed of inputs int (B, t) at positions [start, start + t) (start may be traced)."""
    x = token_embedding(params["tok_embed"], inputs)  # (B, t, D)
    if config.embed_scale:
        x = x * token_scale(config)
    t, D = inputs.shape[-1], config.d_model
    if config.positions == "rope":  # rotary positions turn q and k in attention_cached
        return x
    if config.positions == "learned":
        table = params["pos_embed"]  # (max_seq_len, D)
    else:
        table = sinusoidal_positions(config.max_seq_len, D, x.dtype)
    return x + jax.lax.dynamic_slice(table, (jnp.asarray(start, jnp.int32), jnp.int32(0)), (t, D))


def forward_cached(params, inputs, cache, start, config: ModelConfig):
    """inputs int (B, t) at slots [start, start + t) -> (logits (B, t, V), updated cache)."""
    x = upcast(embed_at(params, inputs, start, config))  # (B, t, D), float32 or wider, as in features

    def layer(x, layer_in):
        p, k, v, l = layer_in
        x, k, v = per_layer(config, l, lambda c: block_cached(p, x, k, v, start, c))  # layer l's kind
        return x, (k, v)

    blocks = (params["blocks"], cache["k"], cache["v"], jnp.arange(config.n_layers))
    x, (k, v) = jax.lax.scan(layer, x, blocks)
    if config.norm != "post":
        x = pick_norm(BLOCK_LAYERS, config)(params["ln_f"], x, config.ln_eps)
    logits = linear(x, *head_weights(params, config), config.compute_dtype)  # (B, t, V)
    if config.logit_softcap:
        logits = softcap(logits, config.logit_softcap)
    return logits, {"k": k, "v": v}


def prefill(params, inputs, config: ModelConfig):
    """inputs int (B, t) into slots [0, t) of a fresh cache of config.max_seq_len slots ->
    (logits (B, t, V), the cache): what every sampler starts with (``jaxformer generate``'s and
    the training loop's held-out replies, training/samples.py)."""
    cache = init_cache(config, inputs.shape[0], params["tok_embed"].dtype)
    return forward_cached(params, inputs, cache, 0, config)
