"""manual_grads.layer_norm against jax.vjp of jaxformer.model.layer_norm, in float64."""

from functools import partial

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxformer.model.layer_norm import layer_norm
from manual_grads.check import assert_trees_close
from manual_grads.layer_norm import layer_norm_bwd, layer_norm_fwd


def make(seed, shape):
    rng = np.random.default_rng(seed)
    D = shape[-1]
    p = {"scale": 1.0 + 0.3 * rng.standard_normal(D), "bias": rng.standard_normal(D)}
    # an offset and a spread per row, so the mean and the variance both matter
    rows = shape[:-1] + (1,)
    x = 3.0 * rng.standard_normal(rows) + np.exp(rng.standard_normal(rows)) * rng.standard_normal(shape)
    return p, x, rng.standard_normal(shape)


def manual(p, x, dy, eps):
    y, res = layer_norm_fwd(p, x, eps)
    return y, layer_norm_bwd(res, dy)


@partial(jax.jit, static_argnums=3)
def reference(p, x, dy, eps):
    y, vjp = jax.vjp(lambda p, x: layer_norm(p, x, eps), p, x)
    return y, vjp(dy)


def check(p, x, dy, eps, jit):
    y, grads = (jax.jit(manual, static_argnums=3) if jit else manual)(p, x, dy, eps)
    y_ref, grads_ref = reference(p, x, dy, eps)
    np.testing.assert_allclose(y, y_ref, rtol=1e-13, atol=1e-13)
    assert_trees_close(grads_ref, grads, rtol=1e-10)


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
    dp, dx = manual(p, x, dy, 1e-5)[1]
    np.testing.assert_array_equal(dx, 0.0)
    np.testing.assert_allclose(dp["bias"], dy.sum(axis=(0, 1)), rtol=1e-14)


@settings(max_examples=4, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), D=st.integers(2, 9),
       seed=st.integers(0, 2**16))
def test_layer_norm_any_shape(shape, D, seed):
    check(*make(seed, (*shape, D)), 1e-5, jit=True)
