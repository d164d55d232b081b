"""Checkpoints: round trip, exact resume, and clear errors for bad checkpoints."""

import errno
import shutil

import chex
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from jaxformer.checkpoints import checkpoint, runs
from jaxformer.checkpoints.checkpoint import CheckpointError
from jaxformer.observe.metrics import RUN_KEYS, read_metrics
from jaxformer.training.loop import train
from jaxformer.training.optim import make_optimizer
from jaxformer.training.resume import restore_newest
from jaxformer.training.step import init_state, state_template
from helpers import tiny_settings

N = 4  # steps before the interruption


def _state(seed=0, accum_steps=1):
    """A small state with every kind of optimizer state node (inject_hyperparams,
    MultiSteps, masked weight decay, adam moments)."""
    optimizer = make_optimizer("adamw", lr=1e-3, schedule="cosine", warmup_steps=2, total_steps=10,
                               clip_norm=1.0, weight_decay=0.1, accum_steps=accum_steps)
    params = {"blocks": {"w": jnp.arange(24.0, dtype=jnp.float32).reshape(2, 3, 4) + seed,
                         "b": jnp.zeros((2, 4), jnp.float32)},
              "head": {"w": jnp.ones((4, 5), jnp.float64) * seed}}
    return init_state(params, optimizer, seed)


META = {"config": {"d_model": 16}, "settings": {"steps": 10}, "tokenizer": {"kind": "char", "chars": ["a", "é"]}}


def test_round_trip(tmp_path):
    state = _state(accum_steps=2)._replace(step=jnp.int32(7), data_index=jnp.int32(9))
    path = checkpoint.save(tmp_path, state, META)
    assert path == tmp_path.absolute() / "checkpoints" / "7"
    template = _state(seed=1, accum_steps=2)
    restored = checkpoint.restore(tmp_path, template)
    chex.assert_trees_all_equal(restored, state)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
    meta = checkpoint.read_meta(tmp_path)
    assert meta["step"] == 7 and meta["tokenizer"] == META["tokenizer"]
    assert checkpoint.latest_step(tmp_path) == 7


def test_restore_params_reads_no_optimizer_state(tmp_path):
    state = _state(accum_steps=2)._replace(step=jnp.int32(7), data_index=jnp.int32(9))
    checkpoint.save(tmp_path, state, META)
    template = _state(seed=1)
    got = checkpoint.restore_params(tmp_path, {"params": template.params, "data_index": template.data_index})
    assert sorted(got) == ["data_index", "params"]
    chex.assert_trees_all_equal(got["params"], state.params)
    assert int(got["data_index"]) == 9


def test_runs_load_params_only(corpus, tmp_path):
    """generate's and diagnose's loader restores the params alone: a template whose
    optimizer state could not be restored (a wrong shape) does not matter to it."""
    result = train(tiny_settings(corpus, steps=2), tmp_path, progress=False)

    def bad_opt_state(config, meta):
        return state_template(config, meta)._replace(opt_state=jax.ShapeDtypeStruct((3,), jnp.float32))

    with pytest.raises(CheckpointError):  # the whole state: the optimizer state is read too
        runs.load_state(tmp_path, bad_opt_state)
    params, _, _, meta = runs.load_run(tmp_path, bad_opt_state)
    chex.assert_trees_all_equal(params, jax.device_get(result.state.params))
    fields, _, _, _ = runs.load_params(tmp_path, bad_opt_state)
    assert sorted(fields) == ["data_index", "params", "step"] and int(fields["step"]) == meta["step"] == 2


def test_keeps_the_latest_few(tmp_path):
    state = _state()
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, state._replace(step=jnp.int32(step)), META, keep=2)
    assert checkpoint.all_steps(tmp_path) == [3, 4]
    restored = checkpoint.restore(tmp_path, state, step=3)
    assert int(restored.step) == 3
    with pytest.raises(CheckpointError, match="no checkpoint for step 1"):
        checkpoint.restore(tmp_path, state, step=1)


def test_missing_checkpoint_names_the_path(tmp_path):
    with pytest.raises(CheckpointError, match=f"no checkpoint found in {tmp_path}"):
        checkpoint.read_meta(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        checkpoint.restore(tmp_path / "nowhere", _state())


def test_corrupted_checkpoint_names_the_path(tmp_path):
    state = _state()
    checkpoint.save(tmp_path, state, META)
    step_dir = tmp_path / "checkpoints" / "0"
    for f in (step_dir / "state").rglob("*"):  # garble every data file of the state
        if f.is_file() and f.name != "commit_success.txt":
            f.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=f"checkpoint step 0 is damaged: {step_dir}/state/"):
        checkpoint.restore(tmp_path, state)
    (step_dir / checkpoint.FILE_DIGESTS).unlink()  # a save that never finished
    with pytest.raises(checkpoint.DamagedCheckpointError, match=f"{step_dir}/files.sha256.json is missing"):
        checkpoint.restore(tmp_path, state)
    (step_dir / "meta" / "metadata").write_text("{not json")
    with pytest.raises(checkpoint.DamagedCheckpointError, match=f"is damaged: cannot read {step_dir}"):
        checkpoint.read_meta(tmp_path)


def test_wrong_shapes_are_refused(tmp_path):
    checkpoint.save(tmp_path, _state(), META)
    other = _state()._replace(params={"w": jnp.zeros((2, 2))})
    with pytest.raises(CheckpointError, match="cannot restore checkpoint|another structure"):
        checkpoint.restore(tmp_path, other)


class _FullDisk:
    """A write future of orbax's async save that fails in orbax's thread."""

    def result(self, timeout=None):
        raise OSError(errno.ENOSPC, "No space left on device")


async def _write_on_full_disk(*args, **kwargs):
    return [_FullDisk()]


def _write_refused(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # orbax's other item save, never awaited
@pytest.mark.parametrize("broken_write", [_write_refused, _write_on_full_disk])
def test_full_disk_is_one_error_and_loses_nothing(tmp_path, monkeypatch, capfd, broken_write):
    """ENOSPC when the save starts or in orbax's writer thread: one CheckpointWriteError
    naming the folder and the cause, no orbax tracebacks, the partial checkpoint removed,
    the earlier one intact."""
    state = _state()._replace(step=jnp.int32(2))
    checkpoint.save(tmp_path, state, META)
    capfd.readouterr()
    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", broken_write)
    with pytest.raises(checkpoint.CheckpointWriteError,
                       match=f"cannot write checkpoint step 3 to {tmp_path}/checkpoints: "
                             r"No space left on device \(ENOSPC\); the partial checkpoint was removed"):
        checkpoint.save(tmp_path, state._replace(step=jnp.int32(3)), META)
    monkeypatch.undo()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ERROR:absl" not in err, err
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]
    chex.assert_trees_all_equal(checkpoint.restore(tmp_path, _state()), state)
    # a leftover temporary folder from a crash is ignored as well
    (tmp_path / "checkpoints" / "5.orbax-checkpoint-tmp-123").mkdir()
    assert checkpoint.latest_step(tmp_path) == 2


def _losses(run_dir):
    return [{k: v for k, v in r.items() if k not in RUN_KEYS} for r in read_metrics(run_dir)]


def test_resume_equals_an_uninterrupted_run(corpus, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    full = train(tiny_settings(corpus, steps=2 * N, eval_every=2), straight, progress=False)
    train(tiny_settings(corpus, steps=N, eval_every=2), resumed, progress=False)
    # a line logged after the checkpoint (as by a run killed before its next save) is dropped
    with open(resumed / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "loss": 0.0}\n')
    again = train(tiny_settings(corpus, steps=2 * N, eval_every=2), resumed, resume=True, progress=False)
    assert [r["step"] for r in again.records] == list(range(N + 1, 2 * N + 1))
    assert _losses(resumed) == _losses(straight)  # exactly, val_loss included
    assert len(_losses(straight)) == 2 * N
    chex.assert_trees_all_equal(again.state, full.state)


def test_resume_refuses_another_config(corpus, tmp_path, capsys):
    train(tiny_settings(corpus, steps=2), tmp_path, progress=False)
    other_model = tiny_settings(corpus, steps=4).replace(preset="sunfish")
    with pytest.raises(CheckpointError, match="model config differs in") as info:
        train(other_model, tmp_path, resume=True, progress=False)
    message = str(info.value)
    assert str(tmp_path) in message
    for field in ("activation", "d_model", "d_ff", "n_heads", "norm", "positions"):
        assert f"{field}: " in message
    with pytest.raises(CheckpointError, match=r"train settings differ in weight_decay: 0.0 \(checkpoint\) vs 0.5"):
        train(tiny_settings(corpus, steps=4, weight_decay=0.5), tmp_path, resume=True, progress=False)
    # the learning rate may change on resume (after a NaN), with a note
    capsys.readouterr()
    result = train(tiny_settings(corpus, steps=3, lr=0.005), tmp_path, resume=True, progress=False)
    assert [r["step"] for r in result.records] == [3]
    assert "note: resuming with lr 0.005 (the checkpoint was trained with 0.01)" in capsys.readouterr().err


def test_resume_without_checkpoint(corpus, tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint found"):
        train(tiny_settings(corpus, steps=2), tmp_path / "empty", resume=True, progress=False)


def test_resume_from_a_copied_run_folder(corpus, tmp_path):
    """The run folder is self-contained: a copy resumes too."""
    train(tiny_settings(corpus, steps=2), tmp_path / "a", progress=False)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    result = train(tiny_settings(corpus, steps=3), tmp_path / "b", resume=True, progress=False)
    assert [r["step"] for r in result.records] == [3]


@pytest.mark.parametrize("error", [OSError(errno.EIO, "Input/output error"), MemoryError("out of memory")])
def test_a_read_error_that_is_not_damage_moves_nothing(tmp_path, monkeypatch, error):
    """An I/O error or out of memory while restoring stops with its own cause: the
    newest checkpoint is not passed over and nothing is set aside."""
    for step in (2, 4):
        checkpoint.save(tmp_path, _state()._replace(step=jnp.int32(step)), META)

    def failing_restore(*args, **kwargs):
        raise error

    monkeypatch.setattr(ocp.CheckpointManager, "restore", failing_restore)
    with pytest.raises(checkpoint.CheckpointReadError,
                       match=f"checkpoints/4 \\(step 4\\): {type(error).__name__}.*not damaged"):
        restore_newest(tmp_path, _state())
    monkeypatch.undo()
    assert checkpoint.all_steps(tmp_path) == [2, 4]
    assert not (tmp_path / checkpoint.DAMAGED_DIR).exists()
    assert int(restore_newest(tmp_path, _state()).step) == 4
