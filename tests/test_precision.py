"""Mixed precision (ModelConfig.compute_dtype) in both gradient sources, float16's
refusal, and the layer norm's range.

bfloat16 gradients are judged as compare-grads judges them: each source against a
reference from the same float32 params without the compute dtype, the manual error at
most compare.MIXED_FACTOR times autodiff's (or than compare.MIXED_FLOOR).
"""

import contextlib
import io
import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_bfloat16_within_autodiff, auto_vg, dot_generals, manual_vg

from jaxformer import init_params, loss_fn
from jaxformer.tools.compare import grads as compare
from jaxformer.cli import compare_grads
from jaxformer.cli.compare_grads import announce_replaced
from jaxformer.model.config import ModelConfig
from jaxformer.model.layer_norm import layer_norm
from jaxformer.model.precision import matmul
from jaxformer.model.transformer import forward
from manual_grads import check, value_and_grad
from manual_grads.layer_norm import layer_norm_bwd, layer_norm_fwd

# one block, every width different; float32 params (the suite turns on x64)
SMALL = ModelConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=1, d_ff=24, max_seq_len=8)


def batch_for(config, B=2, T=8, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, config.vocab_size, (B, T + 1))
    return {"inputs": jnp.asarray(ids[:, :-1], jnp.int32),
            "targets": jnp.asarray(ids[:, 1:], jnp.int32)}


def params_for(config, dtype=jnp.float32):
    return init_params(jax.random.PRNGKey(0), config, dtype)


# ---------------------------------------------------------------------------- bfloat16


@pytest.mark.parametrize("norm,activation,positions", [
    ("pre", "gelu", "learned"), ("post", "relu", "sinusoidal"),
    ("pre", "tanh", "learned"), ("post", "gelu_tanh", "learned"),
])
def test_bfloat16_manual_error_is_within_autodiff_error(norm, activation, positions):
    config = SMALL.replace(norm=norm, activation=activation, positions=positions)
    assert_bfloat16_within_autodiff(params_for(config), batch_for(config), config)


def test_policy_products_in_bfloat16_params_and_grads_in_float32():
    config = SMALL.replace(compute_dtype="bfloat16")
    params, batch = params_for(config), batch_for(config)
    bf16, f32 = jnp.dtype("bfloat16"), jnp.dtype("float32")
    for fn in (partial(loss_fn, config=config), partial(value_and_grad, config=config)):
        closed = jax.make_jaxpr(fn)(params, batch)
        dots = list(dot_generals(closed.jaxpr))
        assert len(dots) >= 7  # q|k|v (one product), scores, values, out, ffn in and out, head, ...
        for eqn in dots:
            assert [v.aval.dtype for v in eqn.invars] == [bf16, bf16], eqn
            assert eqn.outvars[0].aval.dtype == f32, eqn
    loss, grads = manual_vg(params, batch, config)
    assert loss.dtype == f32
    assert all(g.dtype == f32 for g in jax.tree_util.tree_leaves(grads))
    logits = forward(params, batch["inputs"], config)
    assert logits.dtype == f32


def test_without_compute_dtype_no_bfloat16_anywhere():
    params, batch = params_for(SMALL), batch_for(SMALL)
    text = str(jax.make_jaxpr(partial(value_and_grad, config=SMALL))(params, batch))
    text += str(jax.make_jaxpr(jax.grad(partial(loss_fn, config=SMALL)))(params, batch))
    assert "bf16" not in text


@pytest.mark.parametrize("source", [auto_vg, manual_vg], ids=["autodiff", "manual"])
def test_compute_dtype_equal_to_the_params_is_bit_identical(source):
    params, batch = params_for(SMALL), batch_for(SMALL)
    loss0, grads0 = source(params, batch, SMALL)
    loss1, grads1 = source(params, batch, SMALL.replace(compute_dtype="float32"))
    assert float(loss0) == float(loss1)
    for a, b in zip(jax.tree_util.tree_leaves(grads0), jax.tree_util.tree_leaves(grads1)):
        np.testing.assert_array_equal(a, b)


def test_matmul_keeps_float64_and_accumulates_bfloat16_in_float32():
    a = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4)))  # float64
    b = jnp.asarray(np.random.default_rng(1).standard_normal((4, 5)))
    assert matmul(a, b).dtype == jnp.float64
    np.testing.assert_array_equal(matmul(a, b, "float64"), a @ b)
    out = matmul(a.astype(jnp.float32), b.astype(jnp.float32), "bfloat16")
    assert out.dtype == jnp.float32
    exact = np.asarray(a.astype(jnp.bfloat16), np.float64) @ np.asarray(b.astype(jnp.bfloat16), np.float64)
    np.testing.assert_allclose(out, exact, rtol=1e-6)


# ---------------------------------------------------------------------------- float16


@pytest.mark.parametrize("source", [loss_fn, value_and_grad], ids=["autodiff", "manual"])
def test_float16_compute_dtype_is_refused_naming_the_field(source):
    config = SMALL.replace(compute_dtype="float16")
    with pytest.raises(ValueError, match="compute_dtype='float16'"):
        source(params_for(SMALL), batch_for(SMALL), config)


@pytest.mark.parametrize("source", [jax.value_and_grad(loss_fn), value_and_grad],
                         ids=["autodiff", "manual"])
def test_float16_params_are_refused_for_gradients(source):
    with pytest.raises(ValueError, match="params dtype float16"):
        source(params_for(SMALL, jnp.float16), batch_for(SMALL), SMALL)


def test_float16_params_still_run_forward():
    logits = forward(params_for(SMALL, jnp.float16), batch_for(SMALL)["inputs"], SMALL)
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_bad_compute_dtype_names_the_field():
    with pytest.raises(ValueError, match="compute_dtype"):
        ModelConfig(compute_dtype="bf16")


# ---------------------------------------------------------------------------- layer norm range


def ln_inputs(scale, seed=0, D=16):
    rng = np.random.default_rng(seed)
    p = {"scale": 1.0 + 0.3 * rng.standard_normal(D), "bias": rng.standard_normal(D)}
    x = (0.5 + rng.standard_normal((3, D))) * scale  # an offset, so the mean matters
    return p, x, rng.standard_normal((3, D))


@partial(jax.jit, static_argnums=3)
def ln_autodiff(p, x, dy, eps=1e-5):
    y, vjp = jax.vjp(lambda p, x: layer_norm(p, x, eps), p, x)
    return y, vjp(dy)


@partial(jax.jit, static_argnums=3)
def ln_manual(p, x, dy, eps=1e-5):
    y, res = layer_norm_fwd(p, x, eps)
    return y, layer_norm_bwd(res, dy)


def rel(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(got - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("scale", [1e-20, 1.0, 1e10, 1e15, 1e30])
def test_layer_norm_float32_matches_float64_over_the_range(scale):
    p, x, dy = ln_inputs(scale)
    y_ref, (dp_ref, dx_ref) = ln_autodiff(p, x, dy)  # float64
    f32 = lambda a: jax.tree_util.tree_map(lambda v: jnp.asarray(v, jnp.float32), a)  # noqa: E731
    for fn in (ln_autodiff, ln_manual):
        y, (dp, dx) = fn(f32(p), f32(x), f32(dy))
        assert y.dtype == dx.dtype == jnp.float32
        assert rel(y, y_ref) < 1e-6, fn
        assert rel(dx, dx_ref) < 1e-6, fn
        assert rel(dp["scale"], dp_ref["scale"]) < 1e-6 and rel(dp["bias"], dp_ref["bias"]) < 1e-6


@pytest.mark.parametrize("scale", [1e-20, 1.0, 1e15, 1e100])
def test_layer_norm_float64_manual_equals_autodiff_over_the_range(scale):
    p, x, dy = ln_inputs(scale, seed=1)
    y_a, (dp_a, dx_a) = ln_autodiff(p, x, dy)
    y_m, (dp_m, dx_m) = ln_manual(p, x, dy)
    np.testing.assert_allclose(y_m, y_a, rtol=1e-13, atol=1e-13)
    check.assert_trees_close((dp_a, dx_a), (dp_m, dx_m), rtol=1e-10)


# ---------------------------------------------------------------------------- compare-grads


def test_compare_grads_bfloat16_reports_both_errors(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    argv = ["--preset", "tiny", "--compute-dtype", "bfloat16", "--n-layers", "1",
            "--repeats", "1", "--out", str(tmp_path)]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = compare_grads.main(argv)
    stdout = out.getvalue()
    assert rc == 0, stdout + err.getvalue()
    assert "manual err" in stdout and "auto err" in stdout and "products in bfloat16" in stdout
    (p,) = json.loads((tmp_path / "report.json").read_text())["presets"]
    assert p["config"]["compute_dtype"] == "bfloat16" and p["config"]["n_layers"] == 1
    assert p["mixed"] == dict(compute_dtype="bfloat16", factor=compare.MIXED_FACTOR,
                              floor=compare.MIXED_FLOOR)
    for x in p["leaves"]:
        assert x["passed"] and 0 < x["auto_ref_rel"] < 0.1
        assert x["manual_ref_rel"] <= compare.MIXED_FACTOR * max(x["auto_ref_rel"], compare.MIXED_FLOOR)
    assert "manual err vs ref" in (tmp_path / "report.md").read_text()


def test_mixed_criterion_fails_a_leaf_the_manual_source_gets_wrong():
    ref = {"p": np.array([1.0, 2.0, 3.0]), "q": np.array([4.0, 5.0])}
    auto = {"p": ref["p"] * (1 + 3e-3), "q": ref["q"] * (1 - 2e-3)}
    manual = {"p": ref["p"] * (1 + 4e-3), "q": ref["q"] * (1 + 5e-3)}  # q: 2.5 x autodiff's error
    failures = []
    rows = compare._leaf_rows(auto, manual, ref, 1e-4, failures)
    assert [r["passed"] for r in rows] == [True, False]
    assert rows[1]["manual_ref_rel"] == pytest.approx(5e-3) and rows[1]["auto_ref_rel"] == pytest.approx(2e-3)
    assert len(failures) == 1 and failures[0].startswith("q (2,)")
    assert compare.mixed_precision_passed(2 * compare.MIXED_FLOOR, 0.0)
    assert not compare.mixed_precision_passed(2.01 * compare.MIXED_FLOOR, 0.0)


def test_compare_grads_rejects_float16_and_bad_fields(capsys):
    for argv, words in ((["--compute-dtype", "float16"], "compute_dtype"),
                        (["--compute-dtype", "bf16"], "--compute-dtype"),
                        (["--d-model", "15"], "d_model")):
        assert compare_grads.main(["--preset", "tiny", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.splitlines()) == 1 and words in err, err


def test_compare_grads_says_it_replaces_existing_reports(tmp_path, capsys):
    announce_replaced(tmp_path)
    assert capsys.readouterr().out == ""
    (tmp_path / "report.json").write_text("{}")
    announce_replaced(tmp_path)
    assert capsys.readouterr().out == f"replacing the existing report files in {tmp_path}: report.json\n"
