"""manual_grads.activations against jax.vjp of jaxformer.model.ACTIVATION_FNS, in float64."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Layer, assert_layer_matches_vjp

from jaxformer.model.activations import ACTIVATION_FNS
from manual_grads.activations import activation_bwd, activation_fwd

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
