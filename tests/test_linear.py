"""manual_grads.linear against jax.vjp of jaxformer.model.linear, in float64."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Layer, assert_layer_matches_vjp
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxformer.model.linear import linear
from manual_grads.linear import linear_bwd, linear_fwd

LINEAR = Layer(linear_fwd, linear_bwd, lambda p, x: linear(x, p["w"], p["b"]))


def make(seed, lead, I, O):
    rng = np.random.default_rng(seed)
    p = {"w": rng.standard_normal((I, O)), "b": rng.standard_normal(O)}
    return p, rng.standard_normal((*lead, I)), rng.standard_normal((*lead, O))


def check(p, x, dy, jit):
    (_, (dp, dx)), _ = assert_layer_matches_vjp(LINEAR, (p, x), dy, jit=jit)
    assert dp["w"].dtype == dp["b"].dtype == dx.dtype == jnp.float64


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("lead,I,O", [((3, 5), 4, 7), ((1,), 1, 1)])
def test_linear_matches_autodiff(lead, I, O, jit):
    check(*make(0, lead, I, O), jit)


@pytest.mark.parametrize("lead,I,O", [((), 3, 5), ((1, 1), 6, 2), ((2, 1, 3), 5, 5)])
def test_linear_leading_dims(lead, I, O):
    check(*make(1, lead, I, O), jit=True)


@settings(max_examples=4, deadline=None)
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
       I=st.integers(1, 6), O=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_linear_any_shape(lead, I, O, seed):
    check(*make(seed, tuple(lead), I, O), jit=True)
