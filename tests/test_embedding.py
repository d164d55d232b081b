"""manual_grads.embedding against jax.vjp of jaxformer.model.embed, in float64."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Layer, assert_layer_matches_vjp

from jaxformer.model.config import ModelConfig
from jaxformer.model.embedding import embed, sinusoidal_positions, token_embedding
from manual_grads.embedding import (embed_bwd, embed_fwd, learned_positions_bwd,
                                    learned_positions_fwd, token_embed_bwd, token_embed_fwd)


def make(seed, config, B, T):
    rng = np.random.default_rng(seed)
    p = {"tok_embed": rng.standard_normal((config.vocab_size, config.d_model))}
    if config.positions == "learned":
        p["pos_embed"] = rng.standard_normal((config.max_seq_len, config.d_model))
    ids = jnp.asarray(rng.integers(0, config.vocab_size, (B, T)), jnp.int32)
    return p, ids, rng.standard_normal((B, T, config.d_model))


# token ids are not differentiated: embed_bwd gives None for them, jax.vjp nothing
EMBED = Layer(embed_fwd, embed_bwd, embed, cotangents=lambda out: out[:1])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("embed_scale", [False, True], ids=["unscaled", "embed_scale"])
@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
@pytest.mark.parametrize("B,T", [(3, 5), (1, 1), (2, 12)])
def test_embed_matches_autodiff(positions, embed_scale, B, T, jit):
    config = ModelConfig(vocab_size=7, d_model=6, n_heads=2, max_seq_len=12, positions=positions,
                         embed_scale=embed_scale)
    p, ids, dx = make(0, config, B, T)
    # also fails on a missing or extra leaf
    (_, (dp, d_ids)), _ = assert_layer_matches_vjp(EMBED, (p,), dx, consts=(ids,), static=(config,), jit=jit,
                                                   y_rtol=1e-14, y_atol=1e-14)
    assert d_ids is None
    assert set(dp) == set(p)  # no pos_embed when positions are sinusoidal


def test_repeated_ids_accumulate():
    table = np.arange(12.0).reshape(4, 3)
    ids = jnp.array([[0, 0, 2], [0, 1, 2]], jnp.int32)
    dx = np.random.default_rng(1).standard_normal((2, 3, 3))
    x, res = token_embed_fwd(table, ids)
    np.testing.assert_array_equal(x, token_embedding(table, ids))
    dtable, d_ids = token_embed_bwd(res, dx)
    assert d_ids is None
    np.testing.assert_allclose(dtable[0], dx[0, 0] + dx[0, 1] + dx[1, 0], rtol=1e-15)
    np.testing.assert_allclose(dtable[1], dx[1, 1], rtol=1e-15)
    np.testing.assert_allclose(dtable[2], dx[0, 2] + dx[1, 2], rtol=1e-15)
    np.testing.assert_array_equal(dtable[3], 0.0)  # never read


def test_learned_positions_rows_past_T_get_zero():
    table = np.random.default_rng(2).standard_normal((8, 3))
    pos, res = learned_positions_fwd(table, 5)
    np.testing.assert_array_equal(pos, table[:5])
    dtable = learned_positions_bwd(res, np.ones((5, 3)))
    np.testing.assert_array_equal(dtable[:5], 1.0)
    np.testing.assert_array_equal(dtable[5:], 0.0)


def test_sinusoidal_positions_have_no_parameters():
    config = ModelConfig(vocab_size=5, d_model=7, n_heads=1, max_seq_len=9, positions="sinusoidal")
    p, ids, dx = make(3, config, 2, 9)
    x, res = embed_fwd(p, ids, config)
    assert res.pos is None
    table = np.broadcast_to(sinusoidal_positions(9, 7, jnp.float64), x.shape)
    np.testing.assert_allclose(x - p["tok_embed"][np.asarray(ids)], table, rtol=1e-14, atol=1e-14)
    dp, _ = embed_bwd(res, dx)
    assert set(dp) == {"tok_embed"}


def test_embed_scale_multiplies_token_rows_by_sqrt_d_model():
    config = ModelConfig(vocab_size=5, d_model=9, n_heads=3, max_seq_len=4, positions="sinusoidal",
                         embed_scale=True)
    p, ids, dx = make(4, config, 2, 4)
    x, res = embed_fwd(p, ids, config)
    table = sinusoidal_positions(4, 9, jnp.float64)
    np.testing.assert_allclose(x, 3.0 * p["tok_embed"][np.asarray(ids)] + table, rtol=1e-14, atol=1e-14)
    dp, _ = embed_bwd(res, dx)
    unscaled, _ = embed_bwd(embed_fwd(p, ids, config.replace(embed_scale=False))[1], dx)
    np.testing.assert_allclose(dp["tok_embed"], 3.0 * unscaled["tok_embed"], rtol=1e-14)


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_positions_at_given_rows_match_autodiff(positions):
    """``at`` (a permutation of some of the table's rows, as context parallelism's zig-zag order
    reads them): the forward adds row at[t] to token t, and the manual backward adds dx's rows back
    into those rows, as jax.vjp does; reordering the tokens and ``at`` alike reorders x."""
    config = ModelConfig(vocab_size=7, d_model=6, n_heads=2, max_seq_len=12, positions=positions)
    p, ids, dx = make(5, config, 3, 8)
    at = jnp.asarray([0, 1, 6, 7, 2, 3, 4, 5])
    layer = Layer(lambda p, ids, config: embed_fwd(p, ids, config, None, at), embed_bwd,
                  lambda p, ids, config: embed(p, ids, config, None, at), cotangents=lambda out: out[:1])
    (x, (dp, _)), _ = assert_layer_matches_vjp(layer, (p,), dx, consts=(ids,), static=(config,), y_rtol=1e-14,
                                               y_atol=1e-14)
    natural = embed(p, jnp.take(ids, jnp.argsort(at), axis=1), config)  # the same tokens in position order
    np.testing.assert_allclose(x, jnp.take(natural, at, axis=1), rtol=1e-14, atol=1e-14)
    if positions == "learned":
        np.testing.assert_array_equal(dp["pos_embed"][8:], 0.0)  # rows never read
