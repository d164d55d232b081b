"""The memory options (attention_impl, attention_block, loss_chunk, remat) on the whole
model, in float64: manual_grads.value_and_grad and jax.grad of the configured model
equal jax.grad of the PLAIN model (full attention, no chunking, no recompute), over a
pairwise covering set of every option; so does jax.grad of the custom_vjp model.
embed_scale beside these options (and every other) is the pairwise option matrix's
(test_modern_options.py: manual == jax.grad == custom_vjp per leaf)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import LEAN_CASES, LEAN_FIELDS, LEAN_TINY, lean_covering_rows, make_batch, make_params

import jaxformer
import manual_grads
from manual_grads import custom_vjp
from manual_grads.check import assert_trees_close


def plain(config):
    return config.replace(attention_impl="full", loss_chunk=0, remat="none")


def _all(params, batch, config):
    ref = jax.value_and_grad(jaxformer.loss_fn)
    return (ref(params, batch, plain(config)), manual_grads.value_and_grad(params, batch, config),
            ref(params, batch, config))


def _custom_vjp(params, batch, config):
    return (jax.value_and_grad(jaxformer.loss_fn)(params, batch, plain(config)),
            jax.value_and_grad(custom_vjp.loss_fn)(params, batch, config))


ALL = jax.jit(_all, static_argnums=2)  # one compile per case
CUSTOM_VJP = jax.jit(_custom_vjp, static_argnums=2)
NAMES = ("manual", "autodiff of the configured model")


def test_rows_cover_every_pair():
    rows = lean_covering_rows()
    for a, b in itertools.combinations(LEAN_FIELDS, 2):
        seen = {(r[a], r[b]) for r in rows}
        assert seen == set(itertools.product(LEAN_FIELDS[a], LEAN_FIELDS[b])), (a, b)


def check(config, dtype, B, T, mask, fn=ALL, names=NAMES):
    params, batch = make_params(config, dtype), make_batch(config, B, T, mask)
    (loss_ref, grads_ref), *others = fn(params, batch, config)
    assert len(others) == len(names)
    tol = 1e-12 if dtype == jnp.float64 else 1e-6
    for name, (loss, grads) in zip(names, others):
        assert loss.dtype == dtype, name
        np.testing.assert_allclose(loss, loss_ref, rtol=tol, atol=tol, err_msg=name)
        rows = assert_trees_close(grads_ref, grads)  # 1e-10 (float64) or 1e-4 (float32) per leaf
        assert all(g.dtype == dtype for g in jax.tree_util.tree_leaves(grads)), name
    return rows


@pytest.mark.parametrize("case", range(len(LEAN_CASES)),
                         ids=[f"{c.attention_impl}{c.attention_block}-chunk{c.loss_chunk}-{c.remat}"
                              f"-{c.norm}-{'causal' if c.causal else 'bidir'}-{c.positions}"
                              f"-{c.activation}-T{T}" for c, _, T, _ in LEAN_CASES])
def test_options_match_plain_autodiff_float64(case):
    check(*LEAN_CASES[case][:1], jnp.float64, *LEAN_CASES[case][1:])


@pytest.mark.parametrize("norm", ["post"])
def test_custom_vjp_model_honours_the_options(norm):
    """jax.grad of custom_vjp.loss_fn runs the blockwise, chunked and recomputing rules."""
    config = LEAN_TINY.replace(attention_impl="blockwise", attention_block=4, loss_chunk=5, remat="block",
                          norm=norm)
    check(config, jnp.float64, 2, 13, "mostly_zero", CUSTOM_VJP, ("custom_vjp",))


def test_every_option_on_float32():
    """Everything on, float32: within the float32 tolerance of the plain model's jax.grad."""
    config = LEAN_TINY.replace(attention_impl="blockwise", attention_block=4, loss_chunk=5, remat="block")
    rows = check(config, jnp.float32, 2, 13, "mostly_zero")
    assert max(r.rel for r in rows) < 1e-4
