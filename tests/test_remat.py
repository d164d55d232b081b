"""Block recompute (remat "block", manual_grads/remat.py): the forward keeps only each
block's input, and the reverse scan's recomputed residuals give the same gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.model.config import PRESETS
from manual_grads.check import assert_trees_close
from manual_grads import remat
from manual_grads.remat import blocks_bwd, blocks_fwd
from helpers import make_params

CONFIG = PRESETS["tiny"].replace(attention_impl="blockwise", attention_block=4)


@pytest.fixture(params=["scan", "unrolled"])
def layer_loop(request, monkeypatch):
    """Both ways the blocks run: a lax.scan, and the Python loop (shallow models without
    recompute, and any model under a tap, recompute included)."""
    monkeypatch.setattr(remat, "unrolled", lambda config: request.param == "unrolled")
    return request.param


def test_remat_keeps_only_block_inputs(layer_loop):
    params = make_params(CONFIG, jnp.float64)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 9, 16)))
    res = jax.eval_shape(lambda b, x: blocks_fwd(b, x, CONFIG.replace(remat="block"))[1],
                         params["blocks"], x)
    if layer_loop == "scan":
        assert res.shape == (2, 2, 9, 16)  # (L, B, T, D): one input per block, nothing else
    else:
        assert [r.shape for r in res] == [(2, 9, 16)] * 2  # L inputs (B, T, D), nothing else
    kept = sum(leaf.size for leaf in jax.tree_util.tree_leaves(res))
    full = jax.eval_shape(lambda b, x: blocks_fwd(b, x, CONFIG)[1], params["blocks"], x)
    assert sum(leaf.size for leaf in jax.tree_util.tree_leaves(full)) > 5 * kept


def _both(blocks, x, dy):
    out = []
    for config in (CONFIG, CONFIG.replace(remat="block")):
        y, res = blocks_fwd(blocks, x, config)
        out.append((y, blocks_bwd(blocks, res, dy, config)))
    return out


def test_remat_gives_the_same_gradients(layer_loop):
    params = make_params(CONFIG, jnp.float64)
    rng = np.random.default_rng(1)
    x, dy = (jnp.asarray(rng.standard_normal((2, 9, 16))) for _ in range(2))
    (y, grads), (y_remat, grads_remat) = jax.jit(_both)(params["blocks"], x, dy)
    np.testing.assert_array_equal(y, y_remat)
    assert_trees_close(grads, grads_remat, rtol=1e-12)


def test_unrolled_layers_give_the_scans_gradients(monkeypatch):
    """The Python loop of shallow models (UNROLL_MAX_LAYERS) and the scan compute the
    same values: equal forward, gradients to float64 rounding, stacked alike."""
    params = make_params(CONFIG, jnp.float64)
    rng = np.random.default_rng(2)
    x, dy = (jnp.asarray(rng.standard_normal((2, 9, 16))) for _ in range(2))
    out = []
    for limit in (0, 99):
        monkeypatch.setattr(remat, "UNROLL_MAX_LAYERS", limit)
        y, res = blocks_fwd(params["blocks"], x, CONFIG)
        out.append((y, blocks_bwd(params["blocks"], res, dy, CONFIG)))
    assert remat.unrolled(CONFIG) and jax.tree_util.tree_structure(out[0]) == jax.tree_util.tree_structure(out[1])
    assert_trees_close(out[0], out[1], rtol=1e-12)


def test_recompute_scans_at_any_depth():
    """Unrolled, XLA would merge the recomputed forward with the original and keep the
    residuals; the scan keeps recompute's saving (tests/test_memory.py measures it)."""
    assert remat.unrolled(CONFIG) and not remat.unrolled(CONFIG.replace(remat="block"))


DEEP = CONFIG.replace(n_layers=remat.UNROLL_MAX_LAYERS + 1, attention_impl="full")


def test_the_gpu_program_unrolls_every_depth_to_the_scans_gradients():
    """A model deeper than UNROLL_MAX_LAYERS scans on the CPU and a TPU and runs as a Python
    loop in a program lowered for a GPU (model.unroll_on_gpu): the loop's loss and gradients
    equal the scan's to float64 rounding, stacked alike."""
    from manual_grads.model import _value_and_grad
    from helpers import make_batch
    params, batch = make_params(DEEP, jnp.float64), make_batch(DEEP, 2, 9, None)
    scanned, unrolled_ = (jax.jit(lambda p, b, u=u: _value_and_grad(p, b, DEEP, unroll=u))(params, batch)
                          for u in (False, True))
    assert jax.tree_util.tree_structure(scanned) == jax.tree_util.tree_structure(unrolled_)
    assert_trees_close(scanned, unrolled_, rtol=1e-12)


@pytest.mark.parametrize("platform,loops", [("cpu", 2), ("tpu", 2), ("cuda", 0)])
def test_the_layer_loop_follows_the_platform_lowered_for(platform, loops):
    """jax.export of the manual gradients for each platform: the CPU's and a TPU's programs
    keep the forward and backward scans (two while loops), a GPU's has none; recompute
    scans everywhere."""
    from manual_grads import value_and_grad
    from helpers import make_batch
    with jax.enable_x64(False):
        params, batch = make_params(DEEP, jnp.float32), make_batch(DEEP, 2, 9, None)
        for config, want in ((DEEP, loops), (DEEP.replace(remat="block"), 2)):
            exported = jax.export.export(jax.jit(lambda p, b, c=config: value_and_grad(p, b, c)),
                                         platforms=[platform])(params, batch)
            assert exported.mlir_module().count("stablehlo.while") == want, (platform, config.remat)
