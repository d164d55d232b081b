"""What a run tells its user: short runs of any preset, the settings and data block,
compile time apart from the steady state, TensorBoard events, bits per byte, the
presets table, --version and python -m jaxformer."""

import contextlib
import io
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import pytest

from jaxformer import data, get_preset, init_params
from jaxformer.cli.main import main
from jaxformer.model.config import PRESET_TRAINING, PRESETS
from jaxformer.training.optim import make_schedule
from jaxformer.model.params import count_params
from jaxformer.training.settings import recipe_notes, settings_for
from jaxformer.observe.tb import read_scalars
from jaxformer.observe.metrics import read_metrics
from helpers import write_corpus

pytestmark = pytest.mark.xdist_group("test_report")  # one worker: its module fixture (cli_run) runs once

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, timeout=300):
    """`python -m jaxformer ARGS` in a subprocess, this checkout first on the path."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jaxformer", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("steps, accum", [(1, 1), (2, 1), (10, 1), (20, 1), (21, 1), (10, 4)])
def test_a_short_run_of_any_preset_has_a_schedule_that_fits(preset, steps, accum):
    settings = settings_for(preset, steps=steps, accum_steps=accum)
    settings.validate()  # builds the optimizer and its schedule
    updates = -(-steps // accum)
    recipe = PRESET_TRAINING[preset].get("warmup_steps", 0)
    if settings.schedule != "constant":
        assert settings.warmup_steps < updates
    notes = recipe_notes(settings)
    if settings.warmup_steps != recipe:  # shortened: said once, naming the flag
        assert settings.warmup_steps == updates // 10
        assert len(notes) == 1 and "--warmup-steps" in notes[0] and str(recipe) in notes[0]
    else:
        assert notes == []


def test_a_given_warmup_is_kept_and_an_error_names_the_flags():
    assert settings_for("loopos", steps=10, warmup_steps=3).warmup_steps == 3
    with pytest.raises(ValueError, match=r"warmup_steps \(10\) must be smaller .* --warmup-steps"):
        settings_for("loopos", steps=10, warmup_steps=10).validate()
    with pytest.raises(ValueError, match=r"lower --warmup-steps, raise --steps"):
        make_schedule(1.0, "cosine", warmup_steps=5, total_steps=5)


def _main(*args):
    """`jaxformer ARGS` in this process: its exit code, stdout and stderr."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(list(args))
    return SimpleNamespace(returncode=code, stdout=stdout.getvalue(), stderr=stderr.getvalue())


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """A 4-step tiny run through the command line (jaxformer.cli.main.main in this process;
    `python -m jaxformer` itself is test_python_m_jaxformer_and_version's), its corpus capped."""
    tmp = tmp_path_factory.mktemp("report")
    corpus = write_corpus(tmp / "text.txt")
    out = tmp / "run"
    result = _main("train", "--preset", "tiny", "--corpus", corpus, "--max-corpus-bytes", "6000",
                   "--steps", "4", "--log-every", "1", "--eval-every", "2", "--eval-batches", "2",
                   "--out", str(out), "--no-progress")
    assert result.returncode == 0, result.stderr
    return corpus, out, result


def test_train_prints_settings_data_compile_and_named_speeds(cli_run):
    corpus, out, result = cli_run
    err, stdout = result.stderr, result.stdout
    size = os.path.getsize(corpus)
    # the resolved settings, every field
    n_params = count_params(init_params(jax.random.PRNGKey(0), get_preset("tiny", vocab_size=256)))
    assert f"model    tiny: {n_params:,} params (float32)" in err
    for field in ("d_model=16", "n_layers=2", "optimizer=adam", "lr=0.01", "steps=4",
                  "batch_size=8", "seq_len=16", "warmup_steps=0", "max_corpus_bytes=6000"):
        assert field in err, field
    # the gradient source in words, on a line of its own (the default: the hand-derived backward)
    assert "\ngrads    manual (the hand-derived backward, manual_grads; --grads auto for jax.grad)\n" in err
    assert "grads=" not in err
    # the data: source, size, the cap and its flag, tokenizer, vocab, token counts
    records = read_metrics(out)
    assert f"corpus   {corpus}: 6,000 bytes read of {size:,} bytes (capped at 6,000 bytes: " \
           f"--max-corpus-bytes)" in err
    ids = data.ByteTokenizer().encode(data.load_corpus(corpus, max_bytes=6000))
    n_train, n_val = (len(x) for x in data.split_train_val(ids, 0.1))
    assert f"tokens   byte tokenizer, vocab 256; {n_train:,} train / {n_val:,} validation tokens" in err
    # compile apart, then the steady state and the overall speed, each named
    assert "step 1 (compile + first step) took" in err
    assert "steady state" in err and "over 3 steps" in err
    assert "overall" in err and "all tokens / training time" in err
    assert "tokens/s steady state (step times after the first alone)" \
        in stdout
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[0]["compile_s"] > 0 and all("compile_s" not in r for r in records[1:])


def test_validation_in_bits_per_byte_and_tensorboard_events(cli_run):
    _, out, _ = cli_run
    records = read_metrics(out)
    evaluated = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [2, 4]
    for r in evaluated:
        assert r["val_bits_per_byte"] == pytest.approx(r["val_loss"] / math.log(2), rel=1e-12)
    assert len(list(out.glob("events.out.tfevents.*"))) == 1
    scalars = read_scalars(out)
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4]
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"),
                     ("val/loss", "val_loss"), ("val/bits_per_byte", "val_bits_per_byte")):
        want = [(r["step"], r[key]) for r in records if key in r]
        got = scalars[tag]
        assert [s for s, _ in got] == [s for s, _ in want], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), tag
    # the speed of the first record includes compiling: left out of TensorBoard
    assert [s for s, _ in scalars["train/tokens_per_s"]] == [2, 3, 4]


def test_event_files_load_tensorboardx_without_torch(tmp_path):
    """A fresh process writes and reads an event file without importing torch (tensorboardX's
    package would, for type annotations only); torch still imports after it, and where torch is
    already loaded the events are the same."""
    code = ("import os, sys\nfrom jaxformer.observe import tb\nos.makedirs(sys.argv[1])\n"
            "log = tb.EventLog(sys.argv[1]); log.write({'step': 1, 'loss': 2.5}); log.close()\n"
            "assert tb.read_scalars(sys.argv[1])['train/loss'] == [(1, 2.5)]\n"
            "print('torch' in sys.modules)\nimport torch\nprint(torch.tensor([1.0]).sum().item())\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "1.0"]
    done = subprocess.run([sys.executable, "-c", "import torch\n" + code, str(tmp_path / "b")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["True", "1.0"], done.stderr[-3000:]


def test_resume_is_marked_in_metrics_and_events(cli_run, tmp_path, capsys):
    import shutil

    _, out, _ = cli_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    assert main(["train", "--out", str(run), "--resume", "--steps", "6", "--no-progress"]) == 0
    assert "step 5 (compile + first step)" in capsys.readouterr().err
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if r.get("resumed")] == [5]
    scalars = read_scalars(run)
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert scalars["run/resumed"] == [(5, 1.0)]


def test_stdlib_is_read_whole_and_a_cap_is_said_with_its_flag():
    text = data.describe_corpus("stdlib", None, 12 * 2**20)
    assert text.startswith("stdlib (the .py sources under ") and "capped" not in text
    text = data.describe_corpus("stdlib", 2**20, 2**20)
    assert "(capped at 1.0 MiB: --max-corpus-bytes)" in text
    assert data.describe_corpus("default", None, 10).startswith("default (the English text")


def test_presets_table_and_train_help(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name, config in PRESETS.items():
        # shapes only: the Hugging Face families' presets have billions of params
        shapes = jax.eval_shape(lambda c=config.replace(vocab_size=256): init_params(jax.random.PRNGKey(0), c))
        n = count_params(shapes)
        row = next(line for line in out.splitlines() if line.startswith(f"{name} "))
        assert row.split()[1:5] == [str(config.n_layers), str(config.d_model),
                                    str(config.n_heads), str(config.d_ff)]
        assert row.endswith(f"{n:,}")
        assert f"  {name}" in out and f"lr={PRESET_TRAINING[name]['lr']}" in out
    assert main(["train", "--help"]) == 0
    help_text = capsys.readouterr().out
    assert "(default: manual)" in " ".join(help_text.split())  # --grads
    for name, recipe in PRESET_TRAINING.items():
        line = next(x for x in help_text.splitlines() if x.startswith(f"  {name} "))
        for key, value in recipe.items():
            assert f"{key}={value}" in line


def test_python_m_jaxformer_and_version():
    from importlib import metadata

    result = _cli("--version", timeout=120)
    assert result.returncode == 0, result.stderr
    try:
        expected = metadata.version("jaxformer")
    except metadata.PackageNotFoundError:
        from jaxformer import __version__ as expected
    assert result.stdout.strip() == f"jaxformer {expected}"


def test_generate_samples_with_top_p_and_reports_time_per_token(cli_run):
    _, out, _ = cli_run
    result = _main("generate", "--run", str(out), "--prompt", "the ", "--max-new-tokens", "6",
                   "--top-p", "0.9", "--num-samples", "2", "--seed", "1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "--- sample 1 of 2" and "--- sample 2 of 2" in lines
    assert "2 x 6 tokens in" in result.stderr and "ms per token position (key/value cache" \
        in result.stderr
    bad = _main("generate", "--run", str(out), "--prompt", "x", "--top-p", "1.5")
    assert bad.returncode == 2 and "error: top_p must be in (0, 1], got 1.5" in bad.stderr
