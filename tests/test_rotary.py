"""manual_grads.rotary against jax.vjp of jaxformer.model.rotary.apply_rope, in float64; the
tables against Hugging Face Llama's formula; what a rotation must keep (norms, q . k
depending on t - s alone); and the custom_vjp drop-in."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Layer, assert_layer_matches_vjp
from jax.test_util import check_grads

from jaxformer.model.rotary import apply_rope, rope_tables
from manual_grads import custom_vjp as cv
from manual_grads.check import assert_trees_close
from manual_grads.rotary import rope_bwd, rope_fwd

ROPE = Layer(rope_fwd, rope_bwd, apply_rope, cotangents=lambda dx: (dx,))


def hf_tables(positions, head_dim, theta):
    """Hugging Face Llama's LlamaRotaryEmbedding, in numpy float64: inv_freq =
    1 / theta^(arange(0, Dh, 2) / Dh), freqs = positions (x) inv_freq, emb = cat(freqs, freqs)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float64) / head_dim))
    freqs = np.outer(np.asarray(positions, np.float64), inv_freq)  # (T, Dh/2)
    emb = np.concatenate((freqs, freqs), axis=-1)  # (T, Dh)
    return np.cos(emb), np.sin(emb)


def make(seed, shape, start=0, theta=10000.0):
    """x and dy of shape (..., T, Dh), and the tables of positions start .. start + T - 1."""
    rng = np.random.default_rng(seed)
    T, Dh = shape[-2:]
    cos, sin = rope_tables(jnp.arange(start, start + T), Dh, theta, jnp.float64)
    return rng.standard_normal(shape), cos, sin, rng.standard_normal(shape)


def check(x, cos, sin, dy, jit=True):
    return assert_layer_matches_vjp(ROPE, (x,), dy, consts=(cos, sin), jit=jit)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
@pytest.mark.parametrize("shape,start", [
    ((2, 3, 7, 8), 0),  # (B, H, T, Dh), odd T
    ((2, 3, 8, 16), 5),  # positions 5 .. 12, as a KV cache's next chunk
    ((3, 9, 4), 0),  # no head axis: (B, T, Dh)
    ((1, 1, 1, 2), 100),  # one position, one pair
])
def test_rope_matches_autodiff(shape, start, theta, jit):
    check(*make(0, shape, start, theta), jit=jit)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
@pytest.mark.parametrize("positions", [np.arange(8), np.arange(5, 13), np.array([0, 3, 1000, 131071])])
def test_rope_tables_are_hugging_faces(positions, theta):
    cos, sin = rope_tables(jnp.asarray(positions), 16, theta, jnp.float64)
    cos_hf, sin_hf = hf_tables(positions, 16, theta)
    assert cos.shape == sin.shape == (positions.size, 16) and cos.dtype == jnp.float64
    # |angle| up to 1.3e5: float64 round-off of the angle is ~1e-11 absolute
    np.testing.assert_allclose(cos, cos_hf, rtol=0, atol=1e-10)
    np.testing.assert_allclose(sin, sin_hf, rtol=0, atol=1e-10)
    cos32, sin32 = rope_tables(jnp.asarray(positions[:2]), 16, theta, jnp.float32)
    assert cos32.dtype == sin32.dtype == jnp.float32
    np.testing.assert_allclose(cos32, cos_hf[:2], rtol=0, atol=1e-6)


def test_rope_pairs_feature_i_with_i_plus_half():
    """Hugging Face's layout, written as 2-d rotations: (x_i, x_{i+Dh/2}) turns by t theta^(-2i/Dh)."""
    rng = np.random.default_rng(1)
    T, Dh, theta = 5, 8, 10000.0
    x = rng.standard_normal((T, Dh))
    y = apply_rope(x, *rope_tables(jnp.arange(T), Dh, theta, jnp.float64))
    a = np.arange(T)[:, None] * theta ** (-2.0 * np.arange(Dh // 2) / Dh)  # (T, Dh/2)
    x1, x2 = x[:, : Dh // 2], x[:, Dh // 2:]
    expected = np.concatenate([x1 * np.cos(a) - x2 * np.sin(a), x2 * np.cos(a) + x1 * np.sin(a)], axis=-1)
    np.testing.assert_allclose(y, expected, rtol=0, atol=1e-14)


def test_rope_keeps_norms_and_bwd_is_its_inverse():
    """A rotation keeps each position's norm, and its transpose (the backward) undoes it."""
    x, cos, sin, _ = make(2, (2, 3, 9, 8), start=5)
    y, res = rope_fwd(x, cos, sin)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-14)
    assert not np.allclose(y, x)  # it did turn
    np.testing.assert_allclose(rope_bwd(res, y), x, rtol=0, atol=1e-14)


def test_rope_bwd_is_the_transpose():
    """<rope(x), g> = <x, rope_bwd(g)> for any x and g: the backward is the adjoint, without autodiff."""
    x, cos, sin, g = make(3, (2, 2, 7, 6), start=3, theta=500000.0)
    y, res = rope_fwd(x, cos, sin)
    np.testing.assert_allclose(np.vdot(y, g), np.vdot(x, rope_bwd(res, g)), rtol=1e-13)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_rope_scores_depend_on_t_minus_s(theta):
    """q_t . k_s after rope is the same for every (t, s) with the same t - s, and changes with t - s."""
    rng = np.random.default_rng(4)
    Dh = 16
    q, k = rng.standard_normal(Dh), rng.standard_normal(Dh)
    positions = jnp.arange(0, 2000)
    cos, sin = rope_tables(positions, Dh, theta, jnp.float64)
    q_rot = np.asarray(apply_rope(np.broadcast_to(q, (2000, Dh)), cos, sin))  # (T, Dh): q at each position
    k_rot = np.asarray(apply_rope(np.broadcast_to(k, (2000, Dh)), cos, sin))
    scores = {}
    for offset in (0, 1, 3, 7):
        same = [q_rot[s + offset] @ k_rot[s] for s in (0, 5, 12, 400, 1990 - offset)]
        np.testing.assert_allclose(same, same[0], rtol=1e-11, atol=1e-11)
        np.testing.assert_allclose(q_rot[5] @ k_rot[5 + offset], q_rot[900] @ k_rot[900 + offset], rtol=1e-11)
        scores[offset] = same[0]
    assert len({round(v, 6) for v in scores.values()}) == len(scores)  # the offset does matter


# ---------------------------------------------------------------- the custom_vjp drop-in


def test_custom_vjp_apply_rope_runs_the_manual_backward():
    """jax.vjp of custom_vjp.apply_rope gives rope_bwd's dx and zero table cotangents,
    its output is the model's, and check_grads (reverse mode, finite differences) passes."""
    x, cos, sin, dy = make(5, (2, 3, 7, 8), start=5)
    f = jax.jit(cv.apply_rope)
    y, vjp = jax.vjp(f, x, cos, sin)
    y_manual, res = rope_fwd(x, cos, sin)
    np.testing.assert_allclose(y, apply_rope(x, cos, sin), rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(y, y_manual, rtol=1e-14, atol=1e-14)
    dx, dcos, dsin = vjp(dy)
    assert_trees_close(rope_bwd(res, dy), dx, rtol=1e-13)
    np.testing.assert_array_equal(dcos, 0.0)
    np.testing.assert_array_equal(dsin, 0.0)
    check_grads(jax.jit(lambda x: cv.apply_rope(x, cos, sin)), (x,), order=1, modes=["rev"])
    # under jax.grad with the tables built from positions inside the function, as the model does
    g = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(cv.apply_rope(x, *rope_tables(jnp.arange(5, 12), 8,
                                                                                10000.0, x.dtype))))))(x)
    g_ref = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(apply_rope(x, *rope_tables(jnp.arange(5, 12), 8,
                                                                              10000.0, x.dtype))))))(x)
    assert_trees_close(g_ref, g, rtol=1e-12)
