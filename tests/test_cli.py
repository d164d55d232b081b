"""The `jaxformer` command: train then generate in-process, errors as one line, --help."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxformer.checkpoints import checkpoint
from jaxformer.cli.main import main
from helpers import one_line_error

pytestmark = pytest.mark.xdist_group("test_cli")  # one worker: its module fixture (run_dir) runs once


def _train_args(corpus, out, *extra):
    return ["train", "--preset", "tiny", "--corpus", corpus, "--steps", "3", "--out", str(out),
            "--log-every", "1", "--eval-batches", "2", "--no-progress", *extra]


@pytest.fixture(scope="module")
def run_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    assert main(_train_args(corpus, out)) == 0
    return out


def test_train_writes_a_run_folder(run_dir, capsys):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "val_loss" in records[-1]
    assert (run_dir / "loss.png").exists()
    assert (run_dir / "checkpoints" / "3").is_dir()


def test_generate_from_the_run(run_dir, capsys):
    capsys.readouterr()
    code = main(["generate", "--run", str(run_dir), "--prompt", "the cat", "--max-new-tokens", "8",
                 "--temperature", "0"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("the cat") and len(out.rstrip("\n")) >= len("the cat")
    code = main(["generate", "--run", str(run_dir), "--prompt", "the cat", "--max-new-tokens", "8",
                 "--temperature", "0"])
    captured = capsys.readouterr()
    assert code == 0 and captured.out == out  # greedy: the same text again
    assert f"sampling from {run_dir}, checkpoint step 3 (the newest that verifies)" in captured.err


def test_generate_help_lists_only_the_flags_it_accepts(capsys):
    assert main(["generate", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in ("--attention-impl", "--remat", "--compute-dtype", "--step", "--top-p"):
        assert flag in text, flag
    for flag in ("--d-model", "--n-layers", "--vocab-size", "--dropout", "default: the preset's"):
        assert flag not in text, flag


def test_resume_continues_with_the_saved_settings(run_dir, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    capsys.readouterr()
    assert main(["train", "--out", str(copy), "--resume", "--steps", "5", "--no-progress"]) == 0
    assert "grads    manual (the hand-derived backward, manual_grads; --grads auto for jax.grad)" \
        in capsys.readouterr().err  # the default the run was saved with
    steps = [json.loads(line)["step"] for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
    # a differing model is refused, naming the fields
    code = main(["train", "--out", str(copy), "--resume", "--preset", "cllm", "--steps", "9",
                 "--no-progress"])
    line = one_line_error(capsys, code)
    assert "model config differs in activation: 'gelu' (checkpoint) vs 'tanh' (requested)" in line
    assert "d_model: 16 (checkpoint) vs 64 (requested)" in line


@pytest.mark.parametrize("args, message", [
    (["train", "--preset", "huge", "--out", "x"], "invalid choice: 'huge'"),
    (["train", "--preset", "tiny"], "the following arguments are required: --out"),
    (["train", "--preset", "tiny", "--steps", "0", "--out", "x"], "expected a positive integer"),
    (["train", "--preset", "tiny", "--lr", "-1", "--out", "{tmp}/a", "--corpus", "{corpus}"],
     "lr must be >= 0"),
    (["train", "--preset", "tiny", "--seq-len", "99", "--out", "{tmp}/a", "--corpus", "{corpus}"],
     "seq_len 99 exceeds the tiny model's max_seq_len 16"),
    (["train", "--preset", "tiny", "--corpus", "{tmp}/missing.txt", "--out", "{tmp}/a"],
     "missing.txt' does not exist"),
    (["train", "--out", "{tmp}/none", "--resume"], "no checkpoint found in"),
    (["generate", "--run", "{tmp}/none", "--prompt", "x"], "no checkpoint found in"),
    (["generate", "--run", "{run}", "--prompt", "x", "--temperature", "-1"],
     "temperature must be >= 0, got -1.0"),
    (["generate", "--run", "{run}", "--prompt", ""], "the prompt is empty"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["train", "--preset", "tiny", "--optimizer", "muon", "--muon-lr", "-1", "--out", "{tmp}/a",
      "--corpus", "{corpus}"], "muon_lr (--muon-lr) must be >= 0.0, got -1.0"),
])
def test_bad_input_is_one_error_line_and_exit_code_2(args, message, tmp_path, corpus, run_dir, capsys):
    args = [a.format(tmp=tmp_path, corpus=corpus, run=run_dir) for a in args]
    line = one_line_error(capsys, main(args))
    assert message in line, line


AUTO_LINE = "grads    auto (jax.grad; --grads manual for the hand-derived backward, manual_grads)"


def test_auto_grads_flag_gives_the_manual_curve_and_resumes_with_it(corpus, run_dir, tmp_path, capsys):
    """--grads auto (jax.grad) trains like the default, the hand-derived backward, and a run
    saved with it resumes with it: the checkpoint's value wins over the default."""
    assert main(_train_args(corpus, tmp_path / "a", "--grads", "auto")) == 0
    assert AUTO_LINE in capsys.readouterr().err
    read = lambda d: [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    auto, manual = read(tmp_path / "a"), read(run_dir)
    assert [r["step"] for r in manual] == [r["step"] for r in auto] == [1, 2, 3]
    for key in ("loss", "grad_norm", "val_loss"):
        a = [r[key] for r in auto if key in r]
        m = [r[key] for r in manual if key in r]
        np.testing.assert_allclose(a, m, rtol=1e-5, err_msg=key)  # float32 round-off
    assert main(["train", "--out", str(tmp_path / "a"), "--resume", "--steps", "4", "--no-progress"]) == 0
    assert AUTO_LINE in capsys.readouterr().err
    assert checkpoint.newest_meta(tmp_path / "a")["settings"]["grads"] == "auto"
    assert 'grads = "auto"' in (tmp_path / "a" / "config.toml").read_text()


def test_grads_default_is_manual_for_every_attention():
    """The hand-derived backward is the default gradient source, with cuDNN's attention too (its
    kernels are a pair of the hand-derived step); --grads auto chooses jax.grad, and says so."""
    from jaxformer.cli import train as cli_train
    from jaxformer.cli.main import build_parser
    from jaxformer.training.settings import grads_text

    def settings(*flags):
        return cli_train.train_settings(build_parser().parse_args(
            ["train", "--out", "unused", "--preset", "tiny", *flags]))

    assert settings().grads == "manual" and settings("--grads", "auto").grads == "auto"
    cudnn = ("--attention-impl", "cudnn", "--compute-dtype", "bfloat16")
    chosen = settings(*cudnn)
    chosen.validate()
    assert chosen.grads == "manual"  # cuDNN's kernels are a pair of the hand-derived step too
    assert grads_text(settings(*cudnn, "--grads", "auto").grads, chosen.model_config()) == \
        "auto (jax.grad; --grads manual for the hand-derived backward, manual_grads)"


def test_help_in_a_subprocess():
    exe = shutil.which("jaxformer")
    cmd = [exe] if exe else [sys.executable, "-m", "jaxformer.cli.main"]
    result = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for word in ("train", "generate", "compare-grads", "examples:"):
        assert word in result.stdout
    assert main(["train", "--help"]) == 0
    assert main(["compare-grads", "--help"]) == 0  # jaxformer.cli.compare_grads


def test_diagnose_help_examples_run(run_dir, capsys):
    """Each example of `jaxformer diagnose --help`, on a run folder (its own run and step
    numbers replaced by this run's)."""
    from jaxformer.cli import diagnose
    examples = [line.split()[2:] for line in diagnose.EPILOG.splitlines()
                if line.strip().startswith("jaxformer diagnose")]
    assert examples
    for argv in examples:
        argv = [str(run_dir) if a == "runs/loopos" else a for a in argv]
        if "--step" in argv:
            argv[argv.index("--step") + 1] = "3"
        capsys.readouterr()
        assert main(["diagnose", *argv]) == 0, capsys.readouterr().err
        assert "checkpoint step 3" in capsys.readouterr().out


def test_muon_flags_reach_the_settings_and_the_config_file(tmp_path):
    """--optimizer muon --muon-lr --muon-momentum parse into TrainSettings, and a run
    folder's config.toml (here written by hand the same way) carries them back."""
    from jaxformer.cli import train as cli_train
    from jaxformer.cli.main import build_parser
    from jaxformer.training.configfile import write_config

    args = build_parser().parse_args(["train", "--out", "unused", "--preset", "tiny", "--optimizer",
                                      "muon", "--muon-lr", "0.03", "--muon-momentum", "0.9"])
    settings = cli_train.train_settings(args)
    assert (settings.optimizer, settings.muon_lr, settings.muon_momentum) == ("muon", 0.03, 0.9)
    settings.validate()
    write_config(tmp_path / "config.toml", settings, settings.model_config(256))
    again = cli_train.train_settings(build_parser().parse_args(
        ["train", "--out", "unused", "--config", str(tmp_path / "config.toml"), "--muon-lr", "0.01"]))
    assert (again.optimizer, again.muon_lr, again.muon_momentum) == ("muon", 0.01, 0.9)
