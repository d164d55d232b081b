"""experiments/reproduce_seeds.py: the stage masks, manual == auto, and the script end to end.

Runs in float64 (x64 is on for the suite, see conftest.py) on the tiny preset."""

import importlib.util
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.model.config import get_preset
from jaxformer.model.params import init_params

ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    path = ROOT / "experiments" / "reproduce_seeds.py"
    spec = importlib.util.spec_from_file_location("reproduce_seeds", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rs = _load_script()

CONFIG = get_preset("tiny", vocab_size=256)
# Leaves (dotted paths) expected to learn in each stage, written out independently of the script.
EMBED_HEAD = {"tok_embed", "pos_embed", "head.w", "head.b"}
FFN = {"blocks.ffn.w_in", "blocks.ffn.b_in", "blocks.ffn.w_out", "blocks.ffn.b_out"}


def _flat(tree):
    return {".".join(str(k.key) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def params_and_grads():
    """float64 params and gradients of the tiny model's tree, drawn at random (no zero
    entry). What learns is decided by the optimizer alone, so any values show it; real
    training runs in the tests below."""
    shapes = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), CONFIG, jnp.float64))
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(lambda s: jnp.asarray(rng.normal(0, 1, s.shape)), shapes)
    grads = jax.tree_util.tree_map(lambda s: jnp.asarray(rng.uniform(0.5, 2.0, s.shape)), shapes)
    return params, grads


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_masks(params_and_grads, stage, optimizer):
    params, grads = params_and_grads
    all_leaves = set(_flat(params))
    expected = {1: EMBED_HEAD, 2: EMBED_HEAD | FFN, 3: all_leaves}[stage]
    labels = _flat(rs.stage_labels(params, stage))
    assert {k for k, v in labels.items() if v == "learn"} == expected

    tx = rs.make_stage_optimizer(optimizer, stage, params)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    new = _flat(jax.tree_util.tree_map(lambda p, u: p + u, params, updates))
    decayed = {k: v * (1 - rs.LR * rs.WEIGHT_DECAY) for k, v in _flat(params).items()}
    moved = {path for path in all_leaves
             if not np.allclose(new[path], decayed[path], rtol=1e-13, atol=1e-15)}
    # frozen leaves only decayed (to round-off); learning leaves moved by their gradient
    assert moved == expected
    for path in all_leaves - expected:
        np.testing.assert_allclose(new[path], decayed[path], rtol=1e-14, atol=0)


def test_decay_matrices_masks_biases_and_norms(params_and_grads):
    params, grads = params_and_grads
    tx = rs.make_stage_optimizer("sgd", 1, params, decay="matrices")
    updates = _flat(jax.jit(tx.update)(grads, tx.init(params), params)[0])
    assert np.all(updates["blocks.ln1.scale"] == 0)  # frozen, not decayed: untouched
    np.testing.assert_allclose(updates["blocks.attn.wq"],
                               -rs.LR * rs.WEIGHT_DECAY * _flat(params)["blocks.attn.wq"], rtol=1e-14)


def test_main_manual_equals_auto_in_float64_and_writes_its_files(tmp_path, capsys):
    out = tmp_path / "rs"
    code = rs.main(["--preset", "tiny", "--steps", "4", "--batch-size", "4", "--seq-len", "16",
                    "--optimizers", "adam", "--stages", "2", "--grads", "manual,auto",
                    "--dtype", "float64", "--out", str(out)])
    assert code == 0
    for name in ("results.json", "results.md", "curves.png"):
        assert (out / name).stat().st_size > 0
    report = json.loads((out / "results.json").read_text())
    manual, auto = report["runs"]
    assert (manual["grads"], auto["grads"]) == ("manual", "auto")
    for r in (manual, auto):
        assert r["stage"] == 2 and r["steps"] == 4 and r["non_finite"] is None
        assert len(r["losses"]) == 4 and math.isfinite(r["val_final"])
    # same seed, same batches, same jitted step: the same losses to float64 round-off
    np.testing.assert_allclose(manual["losses"], auto["losses"], rtol=1e-12, atol=0)
    np.testing.assert_allclose(manual["val_final"], auto["val_final"], rtol=1e-12)
    assert report["agreement"]["2/adam"] < 1e-12
    md = (out / "results.md").read_text()
    assert "4.952 to 4.051" in md and "3.915 to 1.690" in md and "differed" in md
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("2 runs = 1 optimizer (adam) x 1 stage (2) x 2 gradient sources "
                                 "(manual, auto), 4 steps each"), printed[0]
    assert [line.split(":")[0] for line in printed if line.startswith("run ")] == ["run 1/2", "run 2/2"]
    assert "wrote" in printed[-1]


def test_bad_options_are_refused():
    with pytest.raises(SystemExit):
        rs.parse_args(["--stages", "4"])
    with pytest.raises(SystemExit):
        rs.parse_args(["--optimizers", "rmsprop"])
    with pytest.raises(ValueError, match="stage"):
        rs.stage_labels({}, 5)
