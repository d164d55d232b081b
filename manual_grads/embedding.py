"""Embeddings: token rows, learned positions, sinusoidal positions.

    x = tok_embed[inputs] * s + positions[:T]      (B, T, D)

s is sqrt(D) with ``embed_scale``, else 1 (model.embedding.token_scale).

Token ids are integers: their cotangent is None. Sinusoidal positions have no
parameters, so nothing flows back through them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.model.config import ModelConfig
from jaxformer.model.embedding import sinusoidal_positions, token_embedding, token_scale
from jaxformer.model.parallel.regions import TENSOR, trace_mesh_with
from jaxformer.model.parallel.vocab import vocab_token_embedding
from manual_grads.dropout import DropoutRes, dropout_bwd, dropout_fwd
from manual_grads.parallel.vocab import vocab_token_embedding_bwd


EMBED_KEYS = ("tok_embed", "pos_embed")


def embed_params(params):
    """The embedding's slice of params: tok_embed, and pos_embed when positions are learned."""
    return {k: params[k] for k in EMBED_KEYS if k in params}


class TokenEmbedRes(NamedTuple):
    ids: jax.Array  # (B, T) int, the token ids
    table: jax.Array  # (V, D) tok_embed; kept for its shape


def token_embed_fwd(table, ids):
    """table (V, D), ids int (B, T) -> x (B, T, D)."""
    return token_embedding(table, ids), TokenEmbedRes(ids, table)


def token_embed_bwd(res: TokenEmbedRes, dx):
    """dx (B, T, D) -> (dtable (V, D), None).

    Undoes ``x = table[ids]``: a scatter-add of the rows of dx into the rows
    they were read from; an id that appears n times accumulates n rows.
    """
    ids, table = res
    D = table.shape[-1]
    dtable = jnp.zeros(table.shape, dx.dtype).at[ids.reshape(-1)].add(dx.reshape(-1, D))
    return dtable.astype(table.dtype), None


class LearnedPosRes(NamedTuple):
    table: jax.Array  # (max_seq_len, D) pos_embed; kept for its shape
    at: jax.Array | None = None  # (T,) int, the rows read where not the first T (positions' ``at``)


def learned_positions_fwd(table, T, at=None):
    """table (max_seq_len, D) -> its first T rows (T, D), or its rows ``at`` (T,) int."""
    return (table[:T] if at is None else table[at]), LearnedPosRes(table, at)


def learned_positions_bwd(res: LearnedPosRes, dpos):
    """dpos (T, D) -> dtable (max_seq_len, D): undoes ``pos = table[:T]`` (or ``table[at]``:
    each row of dpos added into the row it was read from); rows not read get zero."""
    T = dpos.shape[0]
    rows = slice(T) if res.at is None else res.at
    return jnp.zeros(res.table.shape, dpos.dtype).at[rows].add(dpos).astype(res.table.dtype)


def sinusoidal_positions_fwd(T, D, dtype, at=None):
    """The fixed (T, D) table (its rows ``at`` where given); no parameters, so the residual is None."""
    table = sinusoidal_positions(T, D, dtype)
    return (table if at is None else table[at]), None


class VocabRowsRes(NamedTuple):  # the rows split over a tensor axis (parallel/vocab.py)
    ids: jax.Array  # (B, T) int
    table: jax.Array  # (V, D) tok_embed; kept for its shape


class EmbedRes(NamedTuple):
    tok: TokenEmbedRes | VocabRowsRes
    pos: LearnedPosRes | None  # None for sinusoidal and rotary positions
    scale: jax.Array | None = None  # () the factor s on the token rows; None without embed_scale
    drop: DropoutRes | None = None  # the output's dropout key and rate; None: no dropout


def embed_fwd(p, inputs, config: ModelConfig, key=None, at=None):
    """p = {"tok_embed": (V, D), "pos_embed": (max_seq_len, D) if learned};
    inputs int (B, T) -> x (B, T, D); with a ``key`` through dropout at config.dropout;
    ``at`` (T,) int: the tokens' positions where not 0 .. T-1 (the forward's ``embed``)."""
    T = inputs.shape[-1]
    mesh = trace_mesh_with(TENSOR)  # a tensor axis: the table's rows split over it (the forward's token_rows)
    if mesh is None:
        tok, tok_res = token_embed_fwd(p["tok_embed"], inputs)  # (B, T, D)
    else:
        tok, tok_res = vocab_token_embedding(p["tok_embed"], inputs, mesh), VocabRowsRes(inputs, p["tok_embed"])
    scale = None
    if config.embed_scale:
        scale = jnp.asarray(token_scale(config), tok.dtype)  # ()
        tok = tok * scale  # x = token_embedding(...) * token_scale(config)
    if config.positions == "rope":  # no position term: rotary positions act in attention
        x, pos_res = tok, None
    elif config.positions == "learned":
        pos, pos_res = learned_positions_fwd(p["pos_embed"], T, at)  # (T, D)
        x = tok + pos
    else:
        pos, pos_res = sinusoidal_positions_fwd(T, config.d_model, tok.dtype, at)  # (T, D)
        x = tok + pos
    x, drop_res = dropout_fwd(x, config.dropout, key)  # (B, T, D)
    return x, EmbedRes(tok_res, pos_res, scale, drop_res)


def embed_bwd(res: EmbedRes, dx):
    """dx (B, T, D) -> (dp with p's keys, None for the integer inputs).

    Undoes ``x = drop(tok * s + pos)``: the dropout first; then tok gets dx * s, pos
    (broadcast over B) gets dx summed over B.
    """
    dx = dropout_bwd(res.drop, dx)  # dropout(x + positions(...), config.dropout, key)
    dtok = dx if res.scale is None else dx * res.scale  # x = token_embedding(...) * token_scale(config)
    if isinstance(res.tok, VocabRowsRes):  # x = vocab_token_embedding(table, ids, mesh)
        dp = {"tok_embed": vocab_token_embedding_bwd(*res.tok, dtok, trace_mesh_with(TENSOR))}
    else:
        dp = {"tok_embed": token_embed_bwd(res.tok, dtok)[0]}
    if res.pos is not None:
        dp["pos_embed"] = learned_positions_bwd(res.pos, dx.sum(axis=0))
    return dp, None
