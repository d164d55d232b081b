"""manual_grads.custom_vjp: jax.grad through the registered manual rules equals
the manual backward, layer by layer and for the whole model, and mixes with
layers that jax.grad differentiates itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxformer
import manual_grads
from jaxformer.model import layers
from jaxformer.model.config import PRESETS
from manual_grads import custom_vjp as cv
from manual_grads.check import assert_trees_close
from helpers import make_params


RNG = np.random.default_rng(0)
B, T, D, H, F, V = 2, 3, 4, 2, 6, 5


def attn_params():
    p = {}
    for name in "qkvo":
        p["w" + name], p["b" + name] = RNG.standard_normal((D, D)) / 2, RNG.standard_normal(D) / 2
    return p


def ffn_params():
    return {"w_in": RNG.standard_normal((D, F)) / 2, "b_in": RNG.standard_normal(F) / 2,
            "w_out": RNG.standard_normal((F, D)) / 2, "b_out": RNG.standard_normal(D) / 2}


def ln_params():
    return {"scale": 1 + RNG.standard_normal(D) / 3, "bias": RNG.standard_normal(D) / 3}


X = RNG.standard_normal((B, T, D))
CONFIG = PRESETS["tiny"].replace(d_model=D, n_heads=H, d_ff=F, vocab_size=V, max_seq_len=T)
BLOCK = {"ln1": ln_params(), "attn": attn_params(), "ln2": ln_params(), "ffn": ffn_params()}

# (name, manual function, reference function, differentiable args, static args)
LAYERS = [
    ("linear", cv.linear, layers.linear, (X, RNG.standard_normal((D, F)), RNG.standard_normal(F)), ()),
    *[(name, cv.ACTIVATION_FNS[name], layers.ACTIVATION_FNS[name], (X,), ())
      for name in layers.ACTIVATION_FNS],
    ("layer_norm", cv.layer_norm, layers.layer_norm, (ln_params(), X), (1e-5,)),
    ("attention", cv.attention, layers.attention, (attn_params(), X), (CONFIG,)),
    ("attention_bidirectional", cv.attention, layers.attention, (attn_params(), X),
     (CONFIG.replace(causal=False),)),
    ("attention_blockwise", cv.attention, layers.attention, (attn_params(), X),
     (CONFIG.replace(attention_impl="blockwise", attention_block=2),)),
    ("feed_forward", cv.feed_forward, layers.feed_forward, (ffn_params(), X), ("gelu",)),
    ("block_pre", cv.block, layers.block, (BLOCK, X), (CONFIG,)),
    ("block_post", cv.block, layers.block, (BLOCK, X), (CONFIG.replace(norm="post"),)),
]


@pytest.mark.parametrize("layer", LAYERS, ids=[row[0] for row in LAYERS])
def test_layer_grad_is_manual(layer):
    """jax.vjp of the registered layer equals jax.vjp of the jaxformer layer, and
    check_grads (reverse mode, against finite differences) passes."""
    name, fn, ref_fn, args, static = layer
    f = jax.jit(lambda *a: fn(*a, *static))  # jitted: one compile, not one per op
    f_ref = jax.jit(lambda *a: ref_fn(*a, *static))
    y, vjp = jax.vjp(f, *args)
    y_ref, vjp_ref = jax.vjp(f_ref, *args)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    dy = RNG.standard_normal(np.shape(y))
    assert_trees_close(vjp_ref(dy), vjp(dy), rtol=1e-10)
    if not name.startswith("block"):  # the blocks: by the model's check_grads below
        check_grads(f, args, order=1, modes=["rev"])


def test_integer_inputs_get_no_cotangent():
    ids = jnp.array([[0, 1, 1], [4, 0, 1]], jnp.int32)
    p = {"tok_embed": RNG.standard_normal((V, D)), "pos_embed": RNG.standard_normal((T, D))}
    y, vjp = jax.vjp(jax.jit(lambda p: cv.embed(p, ids, CONFIG)), p)
    y_ref, vjp_ref = jax.vjp(jax.jit(lambda p: layers.embed(p, ids, CONFIG)), p)
    np.testing.assert_allclose(y, y_ref, rtol=1e-14)
    dy = RNG.standard_normal(y.shape)
    assert_trees_close(vjp_ref(dy), vjp(dy), rtol=1e-10)
    logits, targets = RNG.standard_normal((B, T, V)), ids
    for mask in (None, np.array([[1.0, 0, 0], [0, 0, 1]])):
        g = jax.jit(jax.grad(cv.cross_entropy))(logits, targets, mask)
        g_ref = jax.jit(jax.grad(jaxformer.cross_entropy))(logits, targets, mask)
        assert_trees_close(g_ref, g, rtol=1e-10)


def test_mixing_manual_and_automatic_layers():
    """A pre-LN sublayer whose layer norm is differentiated by jax.grad and whose
    attention runs the manual rule: the same gradient as all-automatic."""
    p = {"ln": ln_params(), "attn": attn_params()}
    config = CONFIG

    def mixed(p, x):
        return jnp.sum(jnp.sin(x + cv.attention(p["attn"], layers.layer_norm(p["ln"], x, 1e-5), config)))

    def auto(p, x):
        return jnp.sum(jnp.sin(x + layers.attention(p["attn"], layers.layer_norm(p["ln"], x, 1e-5), config)))

    grads = jax.jit(jax.grad(mixed, argnums=(0, 1)))(p, X)
    assert_trees_close(jax.jit(jax.grad(auto, argnums=(0, 1)))(p, X), grads, rtol=1e-10)


def _grads(params, batch, config):
    return (manual_grads.value_and_grad(params, batch, config),
            jax.value_and_grad(cv.loss_fn)(params, batch, config),
            cv.forward(params, batch["inputs"], config),
            jaxformer.forward(params, batch["inputs"], config))


GRADS = jax.jit(_grads, static_argnums=2)


@pytest.mark.parametrize("config", [
    PRESETS["tiny"],
    PRESETS["tiny"].replace(norm="post", positions="sinusoidal", activation="relu", causal=False),
], ids=["pre-learned", "post-sinusoidal"])
def test_custom_vjp_model_grad_is_manual(config):
    """jax.grad of the custom_vjp model equals manual_grads.value_and_grad (the layers'
    check_grads above and the model's finite differences in test_manual_model cover
    the numerics)."""
    params = make_params(config, jnp.float64, seed=1)
    rng = np.random.default_rng(1)
    batch = {"inputs": jnp.asarray(rng.integers(0, config.vocab_size, (3, 5)), jnp.int32),
             "targets": jnp.asarray(rng.integers(0, config.vocab_size, (3, 5)), jnp.int32),
             "mask": (rng.random((3, 5)) < 0.5).astype(np.float64)}
    (loss, grads), (loss_cv, grads_cv), logits_cv, logits = GRADS(params, batch, config)
    np.testing.assert_allclose(logits_cv, logits, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(loss_cv, loss, rtol=1e-12)
    assert_trees_close(grads, grads_cv, rtol=1e-12)
