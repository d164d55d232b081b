"""manual_grads.block (the residual block, pre-LN and post-LN) against jax.vjp of
jaxformer.layers, in float64 (the feed-forward layer on its own: test_mlp.py)."""

from functools import partial

import jax
import numpy as np
import pytest

from jaxformer.model.config import ModelConfig
from jaxformer.model.block import block
from manual_grads.block import PostBlockRes, PreBlockRes, block_bwd, block_fwd
from manual_grads.check import assert_trees_close


def block_params(rng, D, F):
    def w(i, o):
        return rng.standard_normal((i, o)) / np.sqrt(i)

    def b(n):
        return 0.3 * rng.standard_normal(n)

    def ln():
        return {"scale": 1.0 + 0.3 * rng.standard_normal(D), "bias": b(D)}

    attn = {}
    for name in "qkvo":
        attn["w" + name], attn["b" + name] = w(D, D), b(D)
    ffn = {"w_in": w(D, F), "b_in": b(F), "w_out": w(F, D), "b_out": b(D)}
    return {"ln1": ln(), "attn": attn, "ln2": ln(), "ffn": ffn}


def manual_block(p, x, dy, config):
    y, res = block_fwd(p, x, config)
    return y, block_bwd(res, dy)


def reference_block(p, x, dy, config):
    y, vjp = jax.vjp(lambda p, x: block(p, x, config), p, x)
    return y, vjp(dy)


@partial(jax.jit, static_argnums=3)
def both_blocks(p, x, dy, config):
    """One compile for the manual block and its reference (the block is tested under
    jit only: eager, its many small ops compile one by one)."""
    return manual_block(p, x, dy, config), reference_block(p, x, dy, config)


def check_block(config, B, T, seed=0):
    rng = np.random.default_rng(seed)
    p = block_params(rng, config.d_model, config.d_ff)
    x, dy = rng.standard_normal((2, B, T, config.d_model))
    (y, grads), (y_ref, grads_ref) = both_blocks(p, x, dy, config)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    assert_trees_close(grads_ref, grads, rtol=1e-10)


# every activation, each norm twice, both maskings; shapes with T = 1, one head,
# odd B and T, d_ff below and above d_model (test_mlp.py covers every activation
# on the feed-forward layer alone)
@pytest.mark.parametrize("B,T,D,H,F,activation,norm,causal", [
    (3, 5, 8, 2, 12, "gelu", "pre", True),
    (1, 1, 4, 1, 6, "relu", "post", True),  # T = 1, one head
    (3, 7, 6, 3, 5, "gelu_tanh", "post", False),  # odd B and T, F < D
    (2, 5, 6, 1, 10, "tanh", "pre", False),  # one head
])
def test_block_matches_autodiff(B, T, D, H, F, activation, norm, causal):
    config = ModelConfig(d_model=D, n_heads=H, d_ff=F, activation=activation, norm=norm, causal=causal)
    check_block(config, B, T)


def test_residual_type_names_the_block():
    rng = np.random.default_rng(3)
    p, x = block_params(rng, 4, 6), rng.standard_normal((1, 2, 4))
    for norm, res_type in (("pre", PreBlockRes), ("post", PostBlockRes)):
        config = ModelConfig(d_model=4, n_heads=2, d_ff=6, norm=norm)
        _, res = jax.eval_shape(lambda p, x: block_fwd(p, x, config), p, x)
        assert isinstance(res, res_type)
