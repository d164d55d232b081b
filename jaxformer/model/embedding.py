"""Token and position embeddings: tok_embed[ids] (times sqrt(D) with embed_scale) +
positions (learned or sinusoidal; none here with rotary positions, which act in attention)."""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxformer.model.config import ModelConfig
from jaxformer.model.dropout import dropout
from jaxformer.model.parallel.regions import TENSOR, trace_mesh_with
from jaxformer.model.parallel.vocab import vocab_token_embedding

def sinusoidal_positions(T, D, dtype=jnp.float32):
    """(T, D) table: sin(t / 10000^(2i/D)) at feature 2i, cos(...) at feature 2i+1."""
    t = jnp.arange(T, dtype=jnp.promote_types(dtype, jnp.float32))[:, None]
    i = jnp.arange(0, D, 2, dtype=t.dtype)[None, :]
    angle = t / (10000.0 ** (i / D))  # (T, ceil(D/2))
    table = jnp.zeros((T, D), t.dtype)
    table = table.at[:, 0::2].set(jnp.sin(angle))
    table = table.at[:, 1::2].set(jnp.cos(angle[:, : D // 2]))
    return table.astype(dtype)


def positions(params, T, config: ModelConfig, dtype, at=None):
    """The (T, D) position term added to the token embeddings (0 with rotary positions,
    which turn q and k inside attention instead): positions 0 .. T-1, or ``at`` (T,) int
    where given (the tokens in another order: context parallelism's, parallel/context.py)."""
    if config.positions == "learned":
        return params["pos_embed"][:T] if at is None else params["pos_embed"][at]
    if config.positions == "rope":
        return jnp.zeros((), dtype)
    table = sinusoidal_positions(T, config.d_model, dtype)
    return table if at is None else table[at]


def token_scale(config: ModelConfig) -> float:
    """The factor on the token rows: sqrt(D) with embed_scale (the original Transformer's,
    so unit-amplitude sinusoidal positions do not drown 0.02-scale rows), else 1."""
    return math.sqrt(config.d_model) if config.embed_scale else 1.0


def token_embedding(table, ids):
    """table (V, D), ids int (...) -> the rows table[ids] (..., D)."""
    return jnp.take(table, ids, axis=0)


def token_rows(table, ids):
    """table[ids], the rows split over the tensor axis under a mesh with one (parallel/vocab.py's
    vocab_token_embedding, as the head's columns are), else ``token_embedding``."""
    mesh = trace_mesh_with(TENSOR)
    return token_embedding(table, ids) if mesh is None else vocab_token_embedding(table, ids, mesh)


def embed(params, inputs, config: ModelConfig, key=None, at=None):
    """inputs int (B, T) -> tok_embed[inputs] * token_scale + positions (B, T, D); with a
    ``key`` (that of the embedding, dropout.embed_key) through dropout at config.dropout.
    ``at`` (T,) int: the tokens' positions where they are not 0 .. T-1 (``positions``)."""
    x = token_rows(params["tok_embed"], inputs)
    if config.embed_scale:
        x = x * token_scale(config)
    if config.positions != "rope":  # rotary positions turn q and k inside attention instead
        x = x + positions(params, inputs.shape[-1], config, x.dtype, at)
    return dropout(x, config.dropout, key)
