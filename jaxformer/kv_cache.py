"""The model's forward over a key/value cache, for decoding.

The cache holds, per layer, the keys and values of the tokens seen so far in S =
max_seq_len slots: ``{"k": (L, B, H, S, Dh), "v": (L, B, H, S, Dh)}``. The token in
slot j has position j (so learned positions stay within the table the model was
trained on). ``forward_cached`` runs t new tokens at slots [start, start + t) and
writes their keys and values; a prefill is t = S at start 0 (padding past the
prompt is harmless: later slots are masked, and decoding overwrites them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxformer.config import ModelConfig
from jaxformer.layers import block_cached, embed_at, layer_norm, linear


def init_cache(config: ModelConfig, batch: int, dtype) -> dict:
    """An empty cache: {"k", "v"} each (L, B, H, S, Dh) zeros."""
    shape = (config.n_layers, batch, config.n_heads, config.max_seq_len, config.d_head)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def forward_cached(params, inputs, cache, start, config: ModelConfig):
    """inputs int (B, t) at slots [start, start + t) -> (logits (B, t, V), updated cache)."""
    x = embed_at(params, inputs, start, config)  # (B, t, D)

    def layer(x, layer_in):
        p, k, v = layer_in
        x, k, v = block_cached(p, x, k, v, start, config)
        return x, (k, v)

    x, (k, v) = jax.lax.scan(layer, x, (params["blocks"], cache["k"], cache["v"]))
    if config.norm == "pre":
        x = layer_norm(params["ln_f"], x, config.ln_eps)
    return linear(x, params["head"]["w"], params["head"]["b"]), {"k": k, "v": v}
