"""manual_grads.layer_norm against jax.vjp of jaxformer.model.layer_norm, in float64."""

import numpy as np
import pytest
from helpers import Layer, assert_layer_matches_vjp
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxformer.model.layer_norm import layer_norm
from manual_grads.layer_norm import layer_norm_bwd, layer_norm_fwd

LAYER_NORM = Layer(layer_norm_fwd, layer_norm_bwd, layer_norm)


def make(seed, shape):
    rng = np.random.default_rng(seed)
    D = shape[-1]
    p = {"scale": 1.0 + 0.3 * rng.standard_normal(D), "bias": rng.standard_normal(D)}
    # an offset and a spread per row, so the mean and the variance both matter
    rows = shape[:-1] + (1,)
    x = 3.0 * rng.standard_normal(rows) + np.exp(rng.standard_normal(rows)) * rng.standard_normal(shape)
    return p, x, rng.standard_normal(shape)


def check(p, x, dy, eps, jit):
    assert_layer_matches_vjp(LAYER_NORM, (p, x), dy, static=(eps,), jit=jit)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("shape,eps", [((3, 5, 7), 1e-5), ((1, 1, 4), 0.1)])
def test_layer_norm_matches_autodiff(shape, eps, jit):
    check(*make(0, shape), eps, jit)


@pytest.mark.parametrize("shape", [(2, 3), (2, 1, 3, 6)])
def test_layer_norm_leading_dims(shape):
    check(*make(1, shape), 1e-5, jit=True)


def test_layer_norm_width_one():
    """D = 1: xhat is 0, so dx is 0 and only the bias gets a gradient."""
    p, x, dy = make(1, (2, 3, 1))
    _, res = layer_norm_fwd(p, x, 1e-5)
    dp, dx = layer_norm_bwd(res, dy)
    np.testing.assert_array_equal(dx, 0.0)
    np.testing.assert_allclose(dp["bias"], dy.sum(axis=(0, 1)), rtol=1e-14)


@settings(max_examples=4, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), D=st.integers(2, 9),
       seed=st.integers(0, 2**16))
def test_layer_norm_any_shape(shape, D, seed):
    check(*make(seed, (*shape, D)), 1e-5, jit=True)
