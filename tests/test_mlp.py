"""The feed-forward layer, plain and gated (jaxformer/model/mlp.py), against its
hand-derived pair (manual_grads/mlp.py) in float64: the manual backward equals jax.vjp of
the model's forward leaf by leaf, with and without biases, for every activation; and the
custom_vjp drop-in's jax.grad equals jax.grad of the model's layer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer
from jaxformer.model import layers
from jaxformer.model.config import ACTIVATIONS, MLPS, ModelConfig
from manual_grads import custom_vjp as cv
from manual_grads.check import assert_trees_close
from manual_grads.mlp import (FeedForwardRes, GatedFeedForwardRes, feed_forward_bwd, feed_forward_fwd,
                              gated_feed_forward_bwd, gated_feed_forward_fwd)
from helpers import Layer, assert_layer_matches_vjp

B, T, D, F = 2, 5, 6, 9  # F != D and odd, so a transposed or swapped leaf cannot pass
WEIGHTS = {"plain": (("in", D, F), ("out", F, D)),
           "gated": (("gate", D, F), ("up", D, F), ("down", F, D))}
FFN = Layer(feed_forward_fwd, feed_forward_bwd, layers.feed_forward)
GATED = Layer(gated_feed_forward_fwd, gated_feed_forward_bwd, layers.gated_feed_forward)


def mlp_params(mlp: str, bias: bool, seed: int = 0):
    """One layer's p["ffn"] with O(1) entries (the model's init is too small to show a wrong
    term): w_<name> (i, o) and, with ``bias``, b_<name> (o,)."""
    rng = np.random.default_rng(seed)
    p = {}
    for name, i, o in WEIGHTS[mlp]:
        p["w_" + name] = rng.standard_normal((i, o)) / np.sqrt(i)
        if bias:
            p["b_" + name] = 0.5 * rng.standard_normal(o)
    return p


def inputs(seed: int = 1):
    rng = np.random.default_rng(seed)
    x, dy = rng.standard_normal((2, B, T, D))
    return x, dy


@pytest.mark.parametrize("mlp", MLPS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_params_have_the_models_leaves(mlp, bias):
    config = ModelConfig(d_model=D, n_heads=2, d_ff=F, mlp=mlp, bias=bias)
    shapes = jax.eval_shape(lambda: jaxformer.init_params(jax.random.PRNGKey(0), config))["blocks"]["ffn"]
    assert {k: v.shape[1:] for k, v in shapes.items()} == {k: v.shape for k, v in mlp_params(mlp, bias).items()}


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("mlp", MLPS)
def test_manual_mlp_matches_autodiff(mlp, bias, activation):
    x, dy = inputs()
    assert_layer_matches_vjp(FFN, (mlp_params(mlp, bias), x), dy, static=(activation,), rtol=1e-10)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_gated_pair_on_its_own_matches_autodiff(bias):
    """gated_feed_forward_fwd/bwd called directly, against the model's gated_feed_forward."""
    x, dy = inputs(2)
    assert_layer_matches_vjp(GATED, (mlp_params("gated", bias, seed=3), x), dy, static=("silu",), rtol=1e-10)


@pytest.mark.parametrize("mlp", MLPS)
def test_manual_mlp_matches_autodiff_eagerly(mlp):
    x, dy = inputs(4)
    assert_layer_matches_vjp(FFN, (mlp_params(mlp, True, seed=5), x), dy, static=("gelu",), jit=False,
                             rtol=1e-10)


@pytest.mark.parametrize("mlp, res_type", [("plain", FeedForwardRes), ("gated", GatedFeedForwardRes)])
def test_residual_type_names_the_layer(mlp, res_type):
    x, _ = inputs()
    _, res = jax.eval_shape(lambda p, x: feed_forward_fwd(p, x, "relu"), mlp_params(mlp, True), x)
    assert isinstance(res, res_type)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("mlp", MLPS)
def test_custom_vjp_drop_in_grad_is_jax_grad(mlp, bias, activation):
    """jax.grad through manual_grads.custom_vjp.feed_forward (the manual rule) equals jax.grad
    of jaxformer's feed_forward, for the params and the input."""
    x, dy = inputs(6)
    p = mlp_params(mlp, bias, seed=7)

    def grads(ffn):
        return jax.jit(jax.grad(lambda p, x: jnp.vdot(ffn(p, x, activation), dy), argnums=(0, 1)))(p, x)

    assert_trees_close(grads(layers.feed_forward), grads(cv.feed_forward), rtol=1e-10)
