"""The train step (any gradient source) and the training loop on the tiny preset."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_settings

from jaxformer.checkpoints import checkpoint
from jaxformer.observe.metrics import read_metrics
from jaxformer.training.loop import NonFiniteLossError, train
from jaxformer.training.optim import make_optimizer
from jaxformer.training.settings import settings_for
from jaxformer.training.step import TrainState, grad_source, init_state, make_train_step

pytestmark = pytest.mark.xdist_group("test_train")  # one worker: its module fixture (run) runs once


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    """30 steps with the default gradient source: the hand-derived backward (manual_grads)."""
    out = tmp_path_factory.mktemp("run")
    return train(tiny_settings(corpus, steps=30), out, progress=False)


def test_loss_at_init_is_ln_vocab(run):
    first = run.records[0]
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(math.log(run.config.vocab_size), abs=0.05)


def test_loss_falls_within_a_few_dozen_steps(run):
    losses = [r["loss"] for r in run.records]
    assert np.mean(losses[-5:]) < losses[0] - 1.5, losses
    vals = [r["val_loss"] for r in run.records if "val_loss" in r]
    assert vals[-1] < vals[0]


def test_metrics_file_and_plot(run):
    records = read_metrics(run.run_dir)
    assert records == json.loads(json.dumps(run.records))
    assert [r["step"] for r in records] == list(range(1, 31))
    for r in records:
        assert {"step", "loss", "grad_norm", "update_norm", "lr", "tokens_per_s"} <= set(r)
        assert all(math.isfinite(r[k]) for k in ("loss", "grad_norm", "update_norm", "tokens_per_s"))
        assert r["lr"] == pytest.approx(1e-2)
    assert [r["step"] for r in records if "val_loss" in r] == [10, 20, 30]
    assert (run.run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert checkpoint.all_steps(run.run_dir) == [30]


def test_final_state(run):
    state = run.state
    assert isinstance(state, TrainState)
    assert int(state.step) == 30 and int(state.data_index) == 30
    assert state.params["tok_embed"].dtype == jnp.float32
    assert run.config.vocab_size == run.tokenizer.vocab_size == 256


def _quadratic_grad_fn(params, batch, key=None):
    """A hand-made gradient source: loss = sum((w - target)^2), gradient written out."""
    diff = params["w"] - batch["target"]
    return jnp.sum(diff**2), {"w": 2 * diff}


def test_make_train_step_works_with_any_gradient_source():
    optimizer = make_optimizer("sgd", lr=0.1)
    batch = {"target": jnp.array([1.0, -2.0, 0.5])}
    w0 = jnp.array([0.0, 0.0, 3.0])
    value_and_grad = jax.value_and_grad(lambda p, b: jnp.sum((p["w"] - b["target"]) ** 2))
    auto = lambda params, batch, key=None: value_and_grad(params, batch)  # noqa: E731
    results = []
    for grad_fn in (_quadratic_grad_fn, auto):
        step = make_train_step(grad_fn, optimizer)
        state = init_state({"w": jnp.array(w0)}, optimizer, seed=1)  # the step donates it
        state, m1 = step(state, batch)
        state, m2 = step(state, batch)
        assert set(m1) == {"loss", "grad_norm", "update_norm", "lr"}
        assert int(state.step) == 2 and int(state.data_index) == 2
        results.append((state.params["w"], m1, m2))
    (w_hand, m1, m2), (w_auto, a1, _) = results
    np.testing.assert_allclose(w_hand, w_auto, rtol=1e-12)
    # w1 = w0 - 0.1 * 2 (w0 - t) = 0.8 w0 + 0.2 t; after two steps w - t shrinks by 0.64
    np.testing.assert_allclose(w_hand, batch["target"] + 0.64 * (w0 - batch["target"]), rtol=1e-12)
    diff0 = w0 - batch["target"]
    assert float(m1["loss"]) == pytest.approx(float(jnp.sum(diff0**2)))
    assert float(m1["grad_norm"]) == pytest.approx(float(2 * jnp.linalg.norm(diff0)))
    assert float(m1["update_norm"]) == pytest.approx(0.1 * float(m1["grad_norm"]))
    assert float(m2["loss"]) == pytest.approx(0.64 * float(m1["loss"]))
    assert float(m1["lr"]) == pytest.approx(0.1)
    assert float(a1["loss"]) == pytest.approx(float(m1["loss"]))


def test_plain_optax_optimizer_trains_and_the_records_leave_lr_out(corpus, tmp_path):
    """optax.sgd(0.1), whose rate is no state, through make_train_step: the update of
    make_optimizer("sgd", lr=0.1), metrics without lr. The loop's reporting (RunLog:
    metrics.jsonl, TensorBoard scalars, the loss plot) takes such metrics as they are."""
    import optax

    from jaxformer.observe import tb
    from jaxformer.observe.run_log import RunLog

    batch = {"target": jnp.array([1.0, -2.0, 0.5])}
    out = {}
    for name, optimizer in (("plain", optax.sgd(0.1)), ("made", make_optimizer("sgd", lr=0.1))):
        step = make_train_step(_quadratic_grad_fn, optimizer)
        state, metrics = step(init_state({"w": jnp.array([0.0, 0.0, 3.0])}, optimizer), batch)
        out[name] = (state.params["w"], metrics)
    (w_plain, plain), (w_made, made) = out["plain"], out["made"]
    np.testing.assert_allclose(w_plain, w_made, rtol=1e-12)
    assert set(plain) == {"loss", "grad_norm", "update_norm"}
    assert set(made) == set(plain) | {"lr"}

    settings = tiny_settings(corpus, steps=1)
    log = RunLog(tmp_path, settings, settings.model_config(256), 1, 0, resumed=False, main=True,
                 progress=False)
    log.add(1, plain)
    log.write(log.record(1, log.fetch()[-1][1]))
    log.close()
    (record,) = read_metrics(tmp_path)
    assert "lr" not in record and record["loss"] == pytest.approx(float(plain["loss"]))
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    scalars = tb.read_scalars(tmp_path)
    assert "train/loss" in scalars and "train/lr" not in scalars


def test_gradient_sources_by_name():
    from jaxformer import get_preset

    config = get_preset("tiny")
    assert callable(grad_source("auto", config))
    with pytest.raises(ValueError, match="unknown gradient source"):
        grad_source("numeric", config)
    try:
        fn = grad_source("manual", config)
    except ValueError as e:  # until manual_grads.value_and_grad exists
        assert "manual gradients are not available" in str(e)
    else:
        assert callable(fn)


def test_manual_gradients_train_like_auto_in_float32(run, corpus, tmp_path):
    """The same loop with jax.grad: the float32 curve of the 30-step run (manual_grads,
    the default), to float32 round-off (the gap seen is about 2e-7 relative)."""
    assert tiny_settings(corpus).grads == "manual"
    auto = train(tiny_settings(corpus, steps=30, grads="auto"), tmp_path, progress=False)
    for key in ("loss", "grad_norm", "update_norm", "val_loss"):
        np.testing.assert_allclose([r[key] for r in run.records if key in r],
                                   [r[key] for r in auto.records if key in r], rtol=1e-4, err_msg=key)


def test_manual_gradients_train_like_auto_in_float64(corpus, tmp_path):
    """20 steps from one seed in float64: manual and automatic gradients give the
    same loss curve to 1e-10."""
    runs = {grads: train(tiny_settings(corpus, steps=20, grads=grads, dtype="float64"),
                         tmp_path / grads, progress=False).records
            for grads in ("auto", "manual")}
    assert [r["step"] for r in runs["manual"]] == list(range(1, 21))
    for key in ("loss", "grad_norm", "update_norm", "val_loss"):
        np.testing.assert_allclose([r[key] for r in runs["manual"] if key in r],
                                   [r[key] for r in runs["auto"] if key in r], rtol=1e-10, err_msg=key)


def _nan_grad_fn(params, batch, key=None):
    return jnp.float32(jnp.nan), jax.tree_util.tree_map(jnp.zeros_like, params)


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(corpus, tmp_path):
    train(tiny_settings(corpus, steps=2), tmp_path, progress=False)
    with pytest.raises(NonFiniteLossError, match="non-finite loss at step 3") as info:
        train(tiny_settings(corpus, steps=5), tmp_path, resume=True, progress=False,
              grad_fn=_nan_grad_fn)
    assert "newest healthy checkpoint is step 2" in str(info.value)
    assert checkpoint.all_steps(tmp_path) == [2]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_non_finite_loss_at_the_first_step(corpus, tmp_path):
    with pytest.raises(NonFiniteLossError, match="non-finite loss at step 1"):
        train(tiny_settings(corpus, steps=3), tmp_path, progress=False, grad_fn=_nan_grad_fn)
    assert checkpoint.all_steps(tmp_path) == []


@pytest.mark.parametrize("overrides, message", [
    (dict(seq_len=64), "exceeds the tiny model's max_seq_len 16"),
    (dict(steps=0), "steps must be a positive integer"),
    (dict(grads="numeric"), "unknown gradient source"),
    (dict(optimizer="lion"), "unknown optimizer"),
    (dict(dtype="float16"), "unknown dtype"),
])
def test_bad_settings(corpus, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        train(tiny_settings(corpus, **overrides), tmp_path, progress=False)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        settings_for("huge")


def test_existing_run_needs_resume(run, corpus):
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train(tiny_settings(corpus, steps=3), run.run_dir, progress=False)


def test_settings_refuse_unknown_keys_by_name():
    from jaxformer.training.settings import TrainSettings
    d = TrainSettings().to_dict()
    assert TrainSettings.from_dict(d) == TrainSettings()
    with pytest.raises(ValueError, match="unknown train settings key.*: lrr"):
        TrainSettings.from_dict({**d, "lrr": 0.1})


# ---------------------------------------------------------------- optimizer muon on the tiny preset


def test_muon_trains_the_tiny_preset_with_manual_gradients(corpus, tmp_path):
    result = train(tiny_settings(corpus, steps=20, grads="manual", optimizer="muon", lr=3e-3),
                   tmp_path, progress=False)
    losses = [r["loss"] for r in result.records]
    assert np.mean(losses[-5:]) < losses[0] - 1.0, losses
    assert all(r["muon_lr"] == pytest.approx(0.02) and r["lr"] == pytest.approx(3e-3)
               for r in result.records)


def test_muon_trains_the_tiny_preset_through_the_library_api(corpus):
    """jax.grad as the gradient source, make_optimizer("muon") into make_train_step, on
    byte batches of the corpus."""
    from jaxformer import get_preset, init_params

    config = get_preset("tiny")  # byte vocabulary, max_seq_len 16
    text = np.frombuffer(open(corpus, "rb").read(), np.uint8).astype(np.int32)
    optimizer = make_optimizer("muon", lr=3e-3, muon_lr=0.02)
    state = init_state(init_params(jax.random.PRNGKey(0), config), optimizer)
    step = make_train_step(grad_source("auto", config), optimizer)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(20):
        starts = rng.integers(0, len(text) - 17, size=8)
        tokens = np.stack([text[i:i + 17] for i in starts])
        state, metrics = step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
        losses.append(float(metrics["loss"]))
    assert set(metrics) >= {"loss", "grad_norm", "update_norm", "lr", "muon_lr"}
    assert np.mean(losses[-5:]) < losses[0] - 1.0, losses


def test_muon_resume_is_bit_exact(corpus, tmp_path):
    settings = lambda steps: tiny_settings(corpus, steps=steps, optimizer="muon", lr=3e-3,  # noqa: E731
                                           schedule="cosine", weight_decay=0.01)
    straight = train(settings(6), tmp_path / "a", progress=False)
    train(settings(3).replace(schedule_steps=6), tmp_path / "b", progress=False)
    resumed = train(settings(6), tmp_path / "b", resume=True, progress=False)
    for a, b in zip(jax.tree_util.tree_leaves(straight.state), jax.tree_util.tree_leaves(resumed.state)):
        np.testing.assert_array_equal(a, b)
    strip = lambda d: [{k: r[k] for k in ("step", "loss", "lr", "muon_lr")}  # noqa: E731
                       for r in read_metrics(d) if "loss" in r]
    assert strip(tmp_path / "a") == strip(tmp_path / "b")
