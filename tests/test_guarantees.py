"""What a run guarantees: verified checkpoints with fallback, a faithful resume, a
recorded corpus, a repaired metrics file, healthy checkpoints only, checked params
and masks, and the layer that made a NaN."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import manual_grads
from jaxformer.checkpoints import checkpoint, runs
from manual_grads import norms as manual_norms
from jaxformer.checkpoints.checkpoint import CheckpointError
from jaxformer.model.config import get_preset
from jaxformer.model.params import init_params
from jaxformer.model.transformer import forward, loss_fn
from jaxformer.observe.metrics import read_metrics
from jaxformer.training import diagnose
from jaxformer.training.loop import NonFiniteLossError, train
from jaxformer.training.resume import DataChangedError
from jaxformer.training.settings import TrainSettings
from jaxformer.training.step import state_template
from helpers import LOSS, tiny_settings, write_corpus


def _losses(run_dir, steps):
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if r["step"] in steps]


def _largest_data_file(run_dir, step):
    files = [f for f in (checkpoint.checkpoint_dir(run_dir) / str(step) / "state").rglob("*")
             if f.is_file() and "commit_success" not in f.name]
    return max(files, key=lambda f: f.stat().st_size)


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, one bit
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------------------
# 1. damaged checkpoints


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    train(tiny_settings(corpus, steps=6, ckpt_every=2), out, progress=False)
    return out


def test_resume_falls_back_past_a_damaged_checkpoint(corpus, straight, tmp_path, capsys):
    train(tiny_settings(corpus, steps=4, ckpt_every=2), tmp_path, progress=False)
    assert checkpoint.all_steps(tmp_path) == [2, 4]
    damaged = _largest_data_file(tmp_path, 4)
    _flip_a_byte(damaged)
    capsys.readouterr()
    result = train(tiny_settings(corpus, steps=6, ckpt_every=2), tmp_path, resume=True, progress=False)
    err = capsys.readouterr().err
    assert f"skipped checkpoint step 4, using step 2: checkpoint step 4 is damaged: the bytes of {damaged} differ" in err
    assert (tmp_path / "damaged_checkpoints" / "4").is_dir()
    assert "resuming from checkpoint step 2" in err and "Traceback" not in err
    assert [r["step"] for r in result.records] == [3, 4, 5, 6]
    assert _losses(tmp_path, range(1, 7)) == _losses(straight, range(1, 7))  # exactly


def test_a_save_without_its_file_digests_is_unfinished(corpus, straight, tmp_path, capsys):
    """A checkpoint cut off after orbax committed it but before its files were digested
    never passes as good; a truncated file is named with its size."""
    run = tmp_path / "run"
    import shutil
    shutil.copytree(straight, run)
    step_dir = checkpoint.checkpoint_dir(run) / "6"
    (step_dir / checkpoint.FILE_DIGESTS).unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint step 6 is damaged: .*files.sha256.json is "
                                              r"missing \(the save did not finish\)"):
        runs.load_run(run, state_template, step=6)
    capsys.readouterr()
    params, _, _, meta4 = runs.load_run(run, state_template)  # falls back to step 4
    assert meta4["step"] == 4
    assert capsys.readouterr().err.startswith(
        "warning: skipped checkpoint step 6, using step 4: checkpoint step 6 is damaged")
    f = _largest_data_file(run, 4)
    f.write_bytes(f.read_bytes()[:10])  # truncated
    with pytest.raises(CheckpointError, match=r"checkpoint step 4 is damaged: .* has 10 bytes"):
        runs.load_run(run, state_template, step=4)


def test_all_damaged_is_one_error_line(corpus, straight, tmp_path, capsys):
    import shutil
    shutil.copytree(straight, tmp_path / "run")
    run = tmp_path / "run"
    for step in checkpoint.all_steps(run):
        _flip_a_byte(_largest_data_file(run, step))
    from jaxformer.cli.main import main
    code = main(["generate", "--run", str(run), "--prompt", "the ", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    said, error = err.splitlines()  # what generate is doing, then the one error line
    assert said == f"loading {run} ..." and error.startswith(f"error: no checkpoint in {run}")
    for step in (2, 4, 6):
        assert f"checkpoint step {step} is damaged" in err


def test_a_non_finite_state_is_never_saved(tmp_path):
    from collections import namedtuple
    State = namedtuple("State", "step w")
    with pytest.raises(checkpoint.UnhealthyStateError, match=r"not saving step 3: state.w holds"):
        checkpoint.save(tmp_path, State(jnp.int32(3), jnp.array([1.0, jnp.nan])),
                        {"config": {}, "settings": {}})
    assert checkpoint.all_steps(tmp_path) == []


# ----------------------------------------------------------------------------
# 2-4. a faithful resume


def test_longer_resume_keeps_the_schedule(corpus, tmp_path, capsys):
    settings = tiny_settings(corpus, steps=4, schedule="cosine", eval_every=0)
    train(settings, tmp_path / "a", progress=False)
    capsys.readouterr()
    train(settings.replace(steps=7), tmp_path / "a", resume=True, progress=False)
    err = capsys.readouterr().err
    assert "keeping the cosine schedule's horizon at 4 steps while training to step 7" in err
    same = train(settings.replace(steps=7, schedule_steps=4), tmp_path / "b", progress=False)
    assert _losses(tmp_path / "a", range(1, 8)) == _losses(tmp_path / "b", range(1, 8))
    lrs = [r["lr"] for r in same.records]
    assert lrs[4:] == [pytest.approx(1e-3)] * 3  # the cosine's end: 0.1 * lr, held
    meta = checkpoint.read_meta(tmp_path / "a")
    assert meta["settings"]["schedule_steps"] == 4


def test_changed_corpus_is_refused(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "text.txt")
    train(tiny_settings(corpus, steps=2), tmp_path / "run", progress=False)
    write_corpus(tmp_path / "text.txt", seed=1)  # the same path, other bytes
    with pytest.raises(DataChangedError, match="corpus differ.*--allow-data-change"):
        train(tiny_settings(corpus, steps=3), tmp_path / "run", resume=True, progress=False)
    capsys.readouterr()
    result = train(tiny_settings(corpus, steps=3), tmp_path / "run", resume=True, progress=False,
                   allow_data_change=True)
    assert [r["step"] for r in result.records] == [3]
    assert "warning: the corpus differ" in capsys.readouterr().err


def test_cut_off_metrics_line_is_repaired(corpus, tmp_path, capsys):
    train(tiny_settings(corpus, steps=2), tmp_path, progress=False)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 5.4')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    capsys.readouterr()
    train(tiny_settings(corpus, steps=3), tmp_path, resume=True, progress=False)
    assert "dropped its last line" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


# ----------------------------------------------------------------------------
# 5. non-finite settings


@pytest.mark.parametrize("field, value", [
    ("lr", float("inf")), ("lr", float("nan")), ("clip_value", float("inf")),
    ("clip_norm", float("nan")), ("weight_decay", float("inf")), ("momentum", float("nan")),
    ("val_fraction", float("nan")),
])
def test_non_finite_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        TrainSettings(**{field: value}).validate()


# ----------------------------------------------------------------------------
# 6. params and masks


CONFIG = get_preset("tiny", vocab_size=20)


@pytest.fixture(scope="module")
def params():
    return init_params(jax.random.PRNGKey(0), CONFIG, dtype=jnp.float32)


def _batch():
    ids = jnp.arange(2 * 8, dtype=jnp.int32).reshape(2, 8) % CONFIG.vocab_size
    return {"inputs": ids, "targets": (ids + 1) % CONFIG.vocab_size}


def test_params_that_do_not_fit_are_named(params):
    short = dict(params, tok_embed=params["tok_embed"][:-3])
    with pytest.raises(ValueError, match=r"params\['tok_embed'\] has shape"):
        forward(short, _batch()["inputs"], CONFIG)
    missing = {**params, "blocks": {**params["blocks"], "ln2": {"scale": params["blocks"]["ln2"]["scale"]}}}
    for fn in (lambda p: loss_fn(p, _batch(), CONFIG),
               lambda p: manual_grads.value_and_grad(p, _batch(), CONFIG),
               lambda p: LOSS(p, _batch(), CONFIG)):
        with pytest.raises(ValueError, match=r"params\['blocks'\]\['ln2'\]\['bias'\] is missing"):
            fn(missing)


@pytest.mark.parametrize("bad, message", [(-1.0, "negative"), (np.nan, "NaN or infinite"),
                                          (np.inf, "NaN or infinite")])
def test_bad_mask_values_are_named(params, bad, message):
    mask = np.ones((2, 8), np.float32)
    mask[1, 3] = bad
    batch = dict(_batch(), mask=jnp.asarray(mask))
    for fn in (loss_fn, manual_grads.value_and_grad):
        with pytest.raises(ValueError, match=rf"batch\['mask'\] holds {message}"):
            fn(params, batch, CONFIG)
    # under jit the values cannot be seen: the check leaves the traced call alone
    LOSS(params, dict(_batch(), mask=jnp.ones((2, 8))), CONFIG)


# ----------------------------------------------------------------------------
# 7. which layer made the NaN


def test_diagnosis_names_the_forward_stage(params):
    bad = jax.tree_util.tree_map(lambda x: x, params)
    bad["blocks"]["attn"]["wq"] = bad["blocks"]["attn"]["wq"].at[1].set(jnp.inf)
    d = diagnose.diagnose_batch(bad, _batch(), CONFIG)
    assert d.first.startswith("forward: blocks[1].attn output is non-finite; its input has min ")
    assert "params['wq'] hold non-finite values" in d.first
    ok = diagnose.diagnose_batch(params, _batch(), CONFIG)
    assert ok.first is None and np.isfinite(ok.loss)
    names = [s.name for s in ok.stages]
    assert names[:4] == ["embed", "blocks[0].ln1", "blocks[0].attn", "blocks[0].attn residual"]
    assert all(s.grad_norm > 0 for s in ok.stages if s.name.endswith((".attn", ".ffn", "head")))


def test_diagnosis_names_the_backward_stage(params, monkeypatch):
    calls = []
    real = manual_norms.layer_norm_bwd

    def nan_in_the_last_call(res, dy):  # the backward reaches blocks[0].ln1 last
        dp, dx = real(res, dy)
        calls.append(1)
        if len(calls) == 1 + 2 * CONFIG.n_layers:  # ln_f, then ln2 and ln1 of each block
            dp = dict(dp, scale=dp["scale"].at[0].set(jnp.nan))
        return dp, dx

    monkeypatch.setattr(manual_norms, "layer_norm_bwd", nan_in_the_last_call)
    d = diagnose.diagnose_batch(params, _batch(), CONFIG)
    assert d.first.startswith("backward: blocks[0].ln1 dscale is non-finite; its input gradient has min")


def test_training_stop_names_the_layer(corpus, tmp_path):
    """A checkpoint whose blocks[1].ffn.w_in is finite but so large that x @ w_in
    overflows: the next step's loss is NaN, and the diagnosis names that layer."""
    train(tiny_settings(corpus, steps=1), tmp_path, progress=False)
    state, _, _, meta = runs.load_state(tmp_path, state_template)
    w_in = state.params["blocks"]["ffn"]["w_in"]
    state.params["blocks"]["ffn"]["w_in"] = w_in.at[1].set(jnp.sign(w_in[1]) * 1e38)
    import shutil
    shutil.rmtree(checkpoint.checkpoint_dir(tmp_path) / "1")
    checkpoint.save(tmp_path, state, meta)
    with pytest.raises(NonFiniteLossError) as info:
        train(tiny_settings(corpus, steps=3, ckpt_every=1), tmp_path, resume=True, progress=False)
    message = str(info.value)
    assert "non-finite loss at step 2" in message and "newest healthy checkpoint is step 1" in message
    assert "Step 2's batch, layer by layer: forward: blocks[1].ffn output is non-finite; its input has min" in message
    assert checkpoint.all_steps(tmp_path) == [1]


def _inf_update_of_block_1(params, batch, key=None):
    """A finite gradient whose sgd update (lr 1e30) overflows blocks[1].attn.wq."""
    grads = jax.tree_util.tree_map(jnp.zeros_like, params)
    wq = grads["blocks"]["attn"]["wq"]
    grads["blocks"]["attn"]["wq"] = wq.at[1].set(1e10)
    return jnp.float32(1.0), grads


def test_non_finite_params_are_not_checkpointed(corpus, tmp_path):
    with pytest.raises(NonFiniteLossError) as info:
        train(tiny_settings(corpus, steps=3, optimizer="sgd", lr=1e30, ckpt_every=1), tmp_path,
              progress=False, grad_fn=_inf_update_of_block_1)
    message = str(info.value)
    assert "not saving step 1: state.params['blocks']['attn']['wq'] holds non-finite values" in message
    assert "no checkpoint was written" in message
    assert "came from the gradient source or the optimizer update" in message
    assert checkpoint.all_steps(tmp_path) == []


def test_per_layer_gradient_norms_are_logged(straight):
    records = read_metrics(straight)
    names = {"grad_norm/embed", "grad_norm/block0", "grad_norm/block1", "grad_norm/head"}
    assert names <= set(records[0])
    for r in records:
        total = sum(r[n] ** 2 for n in names)
        assert total == pytest.approx(r["grad_norm"] ** 2, rel=1e-4)
    assert (straight / "grad_norms.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_resume_and_diagnose_in_a_subprocess(corpus, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1])]
                                                     + sys.path), JAX_PLATFORMS="cpu",
               JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    run = tmp_path / "run"
    common = ["--out", str(run), "--corpus", corpus, "--no-progress", "--eval-batches", "1"]
    script = (
        "import sys; from jaxformer.cli.main import main; "
        "a = sys.argv[1:]; i = a.index('--'); "
        "c1 = main(a[:i]); import pathlib; "
        "f = max((p for p in pathlib.Path(a[a.index('--out') + 1], 'checkpoints', '4', 'state')"
        ".rglob('*') if p.is_file() and 'commit' not in p.name), key=lambda p: p.stat().st_size); "
        "b = bytearray(f.read_bytes()); b[len(b) // 2] ^= 1; f.write_bytes(bytes(b)); "
        "c2 = main(a[i + 1:]); "
        "c3 = main(['diagnose', '--run', a[a.index('--out') + 1]]); sys.exit(c1 + c2 + c3)"
    )
    argv = ["train", "--preset", "tiny", "--steps", "4", "--ckpt-every", "2", "--schedule", "cosine",
            *common, "--", "train", "--resume", "--steps", "6", *common]
    out = subprocess.run([sys.executable, "-c", script, *argv], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert "warning: skipped checkpoint step 4, using step 2: checkpoint step 4 is damaged" in out.stderr
    assert "resuming from checkpoint step 2" in out.stderr
    assert "keeping the cosine schedule's horizon at 4 steps while training to step 6" in out.stderr
    assert "checkpoint step 6, training batch 6" in out.stdout
    assert "blocks[1].ffn residual" in out.stdout
    assert "every activation and gradient of the manual forward and backward" in out.stdout


def test_after_a_nan_the_message_says_what_resuming_does(corpus, tmp_path):
    """A run driven to NaN (sgd, lr 1e3): the replay of the failing step from the newest
    checkpoint diverges again, and the message names the settings to change; --resume
    accepts a lower --lr (with a note) and refuses turning clipping on."""
    settings = tiny_settings(corpus, steps=8, ckpt_every=1, optimizer="sgd", lr=1e3)
    with pytest.raises(NonFiniteLossError) as info:
        train(settings, tmp_path, progress=False)
    message = " ".join(str(info.value).split())
    saved = checkpoint.latest_step(tmp_path)
    assert f"non-finite loss at step {saved + 1}" in message, message
    assert (f"Resuming from checkpoint step {saved} at these settings diverges again: a replay of step "
            f"{saved + 1} on the same batch is non-finite; --resume with a lower --lr (now 1000, e.g. "
            "--lr 100); gradient-norm clipping (--clip-norm) changes the optimizer state") in message
    with pytest.raises(checkpoint.CheckpointError, match="clipping cannot be turned on on resume"):
        train(settings.replace(clip_norm=1.0), tmp_path, resume=True, progress=False)
