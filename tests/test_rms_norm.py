"""manual_grads.rms_norm against jax.vjp of jaxformer.model.rms_norm, in float64, and its
custom_vjp drop-in."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Layer, assert_layer_matches_vjp
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.test_util import check_grads

from jaxformer.model.rms_norm import rms_norm
from manual_grads import custom_vjp as cv
from manual_grads.check import assert_trees_close
from manual_grads.rms_norm import rms_norm_bwd, rms_norm_fwd

RMS_NORM = Layer(rms_norm_fwd, rms_norm_bwd, rms_norm)


def make(seed, shape, scale=True, magnitude=1.0):
    """p ({"scale": (D,)} or {}), x and dy of ``shape``; x has an offset and a spread per
    row (an RMS norm does not remove the offset, so it enters rstd), times ``magnitude``."""
    rng = np.random.default_rng(seed)
    D = shape[-1]
    p = {"scale": 1.0 + 0.3 * rng.standard_normal(D)} if scale else {}
    rows = shape[:-1] + (1,)
    x = 3.0 * rng.standard_normal(rows) + np.exp(rng.standard_normal(rows)) * rng.standard_normal(shape)
    return p, magnitude * x, rng.standard_normal(shape)


def check(p, x, dy, eps, jit=True):
    return assert_layer_matches_vjp(RMS_NORM, (p, x), dy, static=(eps,), jit=jit)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("scale", [True, False], ids=["scale", "no_scale"])
@pytest.mark.parametrize("shape,eps", [((3, 5, 7), 1e-5), ((1, 1, 4), 0.1)])
def test_rms_norm_matches_autodiff(shape, eps, scale, jit):
    check(*make(0, shape, scale), eps, jit)


@pytest.mark.parametrize("scale", [True, False], ids=["scale", "no_scale"])
def test_rms_norm_over_heads(scale):
    """QK-norm: q or k (B, H, T, Dh) with one scale (Dh,), summed over B, H and T; odd T."""
    check(*make(1, (2, 3, 5, 8), scale), 1e-6)


def test_rms_norm_no_scale_has_no_gradient_leaf():
    """p = {} gives dp = {} (the harness fails on an extra leaf, this says it plainly)."""
    p, x, dy = make(2, (2, 3, 4), scale=False)
    _, res = rms_norm_fwd(p, x, 1e-5)
    dp, dx = rms_norm_bwd(res, dy)
    assert dp == {} and res.scale is None and dx.shape == x.shape


@pytest.mark.parametrize("magnitude", [1e-20, 1.0, 1e15, 1e100])
def test_rms_norm_float64_over_the_range(magnitude):
    """Rows of every size: mean(x^2) would overflow float64 at 1e200 without row_scale."""
    check(*make(3, (2, 3, 6), magnitude=magnitude), 1e-5)


def test_rms_norm_mixed_magnitude_rows():
    """Rows of very different sizes in one array: each row's statistics are its own."""
    p, x, dy = make(4, (4, 5))
    x = x * np.array([1e-30, 1.0, 1e30, 1e150])[:, None]
    check(p, x, dy, 1e-5)


@partial(jax.jit, static_argnums=(3, 4))
def _vjp_in(p, x, dy, eps, dtype_manual):
    """(y, (dp, dx)) in float32 (the manual pair or jax.vjp) or float64 (jax.vjp)."""
    dtype, manual = dtype_manual
    p, x, dy = jax.tree_util.tree_map(lambda v: jnp.asarray(v, dtype), (p, x, dy))
    if manual:
        y, res = rms_norm_fwd(p, x, eps)
        return y, rms_norm_bwd(res, dy)
    y, vjp = jax.vjp(lambda p, x: rms_norm(p, x, eps), p, x)
    return y, vjp(dy)


def rel(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("magnitude", [1e-20, 1.0, 1e30])
def test_rms_norm_float32_matches_float64_over_the_range(magnitude):
    """In float32 x^2 overflows at |x| ~ 2e19 and underflows below ~1e-23: the manual pair
    and autodiff both stay within float32 round-off of the float64 truth."""
    p, x, dy = make(5, (3, 16), magnitude=magnitude)
    y_ref, (dp_ref, dx_ref) = _vjp_in(p, x, dy, 1e-5, (jnp.float64, False))
    for manual in (False, True):
        y, (dp, dx) = _vjp_in(p, x, dy, 1e-5, (jnp.float32, manual))
        assert y.dtype == dx.dtype == dp["scale"].dtype == jnp.float32
        assert rel(y, y_ref) < 1e-6 and rel(dx, dx_ref) < 1e-6, manual
        assert rel(dp["scale"], dp_ref["scale"]) < 1e-6, manual


@settings(max_examples=4, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), D=st.integers(1, 9),
       scale=st.booleans(), seed=st.integers(0, 2**16))
def test_rms_norm_any_shape(shape, D, scale, seed):
    check(*make(seed, (*shape, D), scale), 1e-5)


# ---------------------------------------------------------------- the custom_vjp drop-in


@pytest.mark.parametrize("scale", [True, False], ids=["scale", "no_scale"])
def test_custom_vjp_rms_norm_runs_the_manual_backward(scale):
    """jax.vjp of custom_vjp.rms_norm gives rms_norm_bwd's cotangents, its output is the
    model's, and check_grads (reverse mode, finite differences) passes."""
    p, x, dy = make(6, (2, 3, 5), scale)
    eps = 1e-5
    y, vjp = jax.vjp(jax.jit(lambda p, x: cv.rms_norm(p, x, eps)), p, x)
    y_manual, res = rms_norm_fwd(p, x, eps)
    np.testing.assert_allclose(y, rms_norm(p, x, eps), rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(y, y_manual, rtol=1e-14, atol=1e-14)
    assert_trees_close(rms_norm_bwd(res, dy), vjp(dy), rtol=1e-13)
    check_grads(jax.jit(lambda p, x: cv.rms_norm(p, x, eps)), (p, x), order=1, modes=["rev"])
