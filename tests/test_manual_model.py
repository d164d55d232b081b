"""manual_grads.value_and_grad, the full model: against jax.value_and_grad of
jaxformer.loss_fn (float64 and float32), and against finite differences (float64)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_batch, make_params

import jaxformer
import manual_grads
from jaxformer.model.config import PRESETS, SMALL_PRESETS
from manual_grads.check import assert_trees_close, finite_difference_check

MANUAL = jax.jit(manual_grads.value_and_grad, static_argnums=2)


def _both(params, batch, config):
    return MANUAL(params, batch, config), jax.value_and_grad(jaxformer.loss_fn)(params, batch, config)


BOTH = jax.jit(_both, static_argnums=2)  # one compile per case for manual and reference


def check(config, dtype, B, T, mask):
    params = make_params(config, dtype)
    batch = make_batch(config, B, T, mask)
    (loss, grads), (loss_ref, grads_ref) = BOTH(params, batch, config)
    assert loss.dtype == dtype
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(params)
    assert all(g.dtype == dtype for g in jax.tree_util.tree_leaves(grads))
    loss_tol = 1e-12 if dtype == jnp.float64 else 1e-6
    np.testing.assert_allclose(loss, loss_ref, rtol=loss_tol, atol=loss_tol)
    rows = assert_trees_close(grads_ref, grads)  # the dtype's tolerance: 1e-10 or 1e-4
    return loss, grads, rows


# Presets (at their sizes, short batches) and tiny configs covering the rest:
# every activation, both norms, both position kinds, causal and not, masks.
TINY = PRESETS["tiny"]
CASES = {
    "loopos": (PRESETS["loopos"], 2, 8, "mostly_zero"),
    "sunfish": (PRESETS["sunfish"], 3, 5, None),
    "cllm": (PRESETS["cllm"], 1, 1, "bool"),  # T = 1
    "tiny": (TINY, 3, 16, None),
    "llama-tiny": (PRESETS["llama-tiny"], 2, 9, "mostly_zero"),
    "gelu_tanh-post-learned-bidirectional": (
        TINY.replace(activation="gelu_tanh", norm="post", causal=False), 3, 5, "mostly_zero"),
    "relu-pre-sinusoidal-bidirectional-1head": (
        TINY.replace(activation="relu", positions="sinusoidal", causal=False, n_heads=1, n_layers=3),
        2, 7, "int"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_model_float64(case):
    config, B, T, mask = CASES[case]
    check(config, jnp.float64, B, T, mask)


@pytest.mark.parametrize("preset", list(SMALL_PRESETS))
def test_model_float32(preset):
    config, B, T, mask = CASES[preset]
    _, _, rows = check(config, jnp.float32, B, T, mask)
    assert max(r.rel for r in rows) < 1e-4


def test_grads_tree_leaves_out_unused_params():
    """No pos_embed with sinusoidal positions, no ln_f with post-norm."""
    config, B, T, mask = CASES["sunfish"]
    _, grads, _ = check(config, jnp.float64, B, T, mask)
    assert "pos_embed" not in grads and "ln_f" not in grads


def test_all_zero_mask_gives_zero_loss_and_grads():
    """A mask that is all zeros gives loss 0 and zero gradients (same compile as the
    covering case with a float mask)."""
    config, B, T, _ = CASES["gelu_tanh-post-learned-bidirectional"]
    loss, grads, _ = check(config, jnp.float64, B, T, "zeros")
    assert float(loss) == 0.0
    assert all(not np.any(np.asarray(g)) for g in jax.tree_util.tree_leaves(grads))


def test_model_finite_differences():
    config, B, T, mask = CASES["gelu_tanh-post-learned-bidirectional"]
    params, batch = make_params(config, jnp.float64), make_batch(config, B, T, mask)
    (_, grads), _ = BOTH(params, batch, config)  # compiled already by test_model_float64
    loss = lambda p: BOTH(p, batch, config)[1][0]  # noqa: E731  jaxformer.loss_fn's value
    checks = finite_difference_check(loss, params, grads, jax.random.PRNGKey(1), n_directions=3)
    assert max(c.rel for c in checks) < 1e-6, checks


def test_jit_traces_once_and_validates():
    config, B, T, mask = CASES["tiny"]
    params = make_params(config, jnp.float64)
    traces = []

    def counted(params, batch, config):
        traces.append(config)
        return manual_grads.value_and_grad(params, batch, config)

    fn = jax.jit(counted, static_argnums=2)
    for seed in range(3):
        fn(params, make_batch(config, B, T, mask, seed=seed), config)
    assert len(traces) == 1
    bad = make_batch(config, B, T, mask)
    bad["inputs"] = bad["inputs"].at[0, 0].set(config.vocab_size)
    with pytest.raises(ValueError, match="outside"):
        manual_grads.value_and_grad(params, bad, config)
    with pytest.raises(ValueError, match="'inputs' and 'targets'"):
        manual_grads.value_and_grad(params, {"inputs": bad["inputs"]}, config)
    with pytest.raises(ValueError, match="max_seq_len"):
        long = make_batch(config, 1, config.max_seq_len + 1, None)
        fn(params, long, config)
