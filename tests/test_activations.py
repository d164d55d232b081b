"""manual_grads.activations against jax.vjp of jaxformer.model.ACTIVATION_FNS, in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Layer, assert_layer_matches_vjp
from jax.test_util import check_grads

from jaxformer.model.activations import ACTIVATION_FNS
from manual_grads import custom_vjp as cv
from manual_grads.activations import ACTIVATION_BWD, ACTIVATION_FWD, activation_bwd, activation_fwd

NAMES = sorted(ACTIVATION_FNS)
SPECIAL = np.array([0.0, 1e-8, -1e-8, 1e-3, -1e-3, 0.5, -0.5, 3.0, -3.0, 10.0, -10.0, 30.0, -30.0])
ACTIVATION = Layer(lambda x, name: activation_fwd(name, x), activation_bwd,
                   lambda x, name: ACTIVATION_FNS[name](x), cotangents=lambda dx: (dx,))


def manual(name, x, dy):
    y, res = activation_fwd(name, x)
    return y, activation_bwd(res, dy)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("name", NAMES)
def test_activation_matches_autodiff(name, jit):
    rng = np.random.default_rng(0)
    x = np.concatenate([2.0 * rng.standard_normal(3 * 5 * 7 - SPECIAL.size), SPECIAL]).reshape(3, 5, 7)
    dy = rng.standard_normal(x.shape)
    (_, dx), (_, (dx_ref,)) = assert_layer_matches_vjp(ACTIVATION, (x,), dy, static=(name,), jit=jit,
                                                       y_rtol=1e-14, y_atol=1e-15)
    # Element by element too, at 0, tiny and saturated inputs. Near saturation dx is a
    # small difference of O(1) terms: gelu_tanh's 1 - tanh(u)^2 carries ~1e-16 absolute
    # round-off, multiplied by x * du/dx (about 15 at |x| = 5), hence atol 1e-14.
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", NAMES)
def test_activation_single_element(name):
    x, dy = np.array([0.7]), np.array([-1.3])
    (_, dx), (_, (dx_ref,)) = assert_layer_matches_vjp(ACTIVATION, (x,), dy, static=(name,), jit=False,
                                                       y_rtol=1e-14, y_atol=1e-15)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-13)


def test_relu_tie_is_half():
    """At x == 0 exactly, relu's slope is 1/2, the subgradient jax.grad picks."""
    _, dx = manual("relu", jnp.zeros(3), jnp.ones(3))
    np.testing.assert_array_equal(dx, 0.5)


def test_relu2_slope_is_two_max_x_0():
    """relu2's slope is exactly 2 max(x, 0): 0 at x == 0 and below, 2x above."""
    x = jnp.array([-2.0, -1e-300, 0.0, 1e-300, 0.25, 3.0])
    y, dx = manual("relu2", x, jnp.ones(6))
    np.testing.assert_array_equal(y, [0.0, 0.0, 0.0, 0.0, 0.0625, 9.0])
    np.testing.assert_array_equal(dx, [0.0, 0.0, 0.0, 2e-300, 0.5, 6.0])


def test_silu_slope_closed_form():
    """silu' = s (1 + x (1 - s)), s = sigmoid(x): 1/2 at 0, 0 at silu's minimum
    (x = -1.27846454276107..., where 1 + x (1 - s) = 0), 1 at large x, and a tiny
    negative value at very negative x."""
    x = np.array([0.0, -1.2784645427610741, 40.0, -40.0])
    _, dx = manual("silu", jnp.asarray(x), jnp.ones(4))
    s = 1.0 / (1.0 + np.exp(-x))
    np.testing.assert_allclose(dx, s * (1.0 + x * (1.0 - s)), rtol=1e-14, atol=1e-16)
    assert dx[0] == 0.5 and abs(dx[1]) < 1e-15 and dx[2] == 1.0 and -1e-15 < dx[3] < 0


def test_every_activation_has_a_pair_and_a_drop_in():
    """A new entry in ACTIVATION_FNS needs its manual pair and its custom_vjp drop-in."""
    assert set(ACTIVATION_FWD) == set(cv.ACTIVATION_FNS) == set(NAMES)
    for name in NAMES:
        _, res = activation_fwd(name, jnp.ones(2))
        assert type(res) in ACTIVATION_BWD, name


@pytest.mark.parametrize("name", NAMES)
def test_custom_vjp_activation_runs_the_manual_backward(name):
    """jax.vjp of custom_vjp.activation gives activation_bwd's dx, and check_grads
    (reverse mode, finite differences) passes away from relu's kink."""
    rng = np.random.default_rng(1)
    x = np.concatenate([2.0 * rng.standard_normal(3 * 5 - 3), [0.0, 9.0, -9.0]]).reshape(3, 5)
    dy = rng.standard_normal(x.shape)
    y, vjp = jax.vjp(jax.jit(lambda x: cv.activation(name, x)), x)
    y_manual, dx_manual = manual(name, x, dy)
    np.testing.assert_allclose(y, ACTIVATION_FNS[name](x), rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(vjp(dy)[0], dx_manual, rtol=1e-13, atol=1e-15)
    check_grads(jax.jit(lambda x: cv.activation(name, x)), (x[:, :4] + 0.01,), order=1, modes=["rev"])
