"""Stopping safely (subprocesses): SIGINT and SIGTERM checkpoint the step reached and
a --resume continues bit-exactly; a second Ctrl-C aborts without harming a checkpoint.

The runs that are stopped are subprocesses; the resumes and the straight runs they are
compared with are `jaxformer train` in this process (jaxformer.cli.main.main, the same
environment and XLA flags as the subprocesses), which compile the train step once for
all of them."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxformer.checkpoints import checkpoint
from jaxformer.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def _argv(corpus, out, steps, *extra):
    return ["train", "--preset", "tiny", "--corpus", corpus, "--steps", str(steps), "--out", str(out),
            "--log-every", "1", "--eval-every", "0", "--eval-batches", "1", "--no-progress",
            "--schedule", "constant", "--warmup-steps", "0", "--dtype", "float64", *extra]


def _env():
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), JAX_DISABLE_MOST_OPTIMIZATIONS="true")


def _losses(out) -> dict:
    lines = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r and "step" in r}


def _start(corpus, out, *extra):
    return subprocess.Popen([sys.executable, "-m", "jaxformer", *_argv(corpus, out, 100000, *extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())


def _wait_for_steps(proc, out, n, timeout=180):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if (Path(out) / "metrics.jsonl").exists() and len(_losses(out)) >= n:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps in {timeout} s")


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_checkpoints_the_step_reached_and_resume_is_exact(corpus, tmp_path, signum, code):
    out = tmp_path / "run"
    proc = _start(corpus, out)
    _wait_for_steps(proc, out, 3)
    sent = time.time()
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    stopped_in = time.time() - sent
    assert proc.returncode == code, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("interrupted")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    reached = max(_losses(out))
    assert checkpoint.all_steps(out) == [reached]  # --ckpt-every 0: only the signal's checkpoint
    assert (f"interrupted by {signal.Signals(signum).name} at step {reached}; checkpoint "
            f"{checkpoint.checkpoint_dir(out) / str(reached)} (saved); resume with: jaxformer train") in lines[0]
    assert lines[0].endswith("--resume"), lines[0]
    # the signal was acknowledged, once, before the run stopped
    heard = [x for x in err.splitlines() if " heard: stopping after the step in flight" in x]
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert len(heard) == 1 and heard[0].startswith(f"{name} heard: ") and err.index(heard[0]) < err.index(lines[0]), err
    assert stopped_in < 30, stopped_in  # the step in flight and one save on a busy 2-core machine
    # resume to two steps further; a straight run to there gives the very same losses
    target = reached + 2
    assert main(_argv(corpus, out, target, "--resume")) == 0
    straight = tmp_path / "straight"
    assert main(_argv(corpus, straight, target)) == 0
    assert sorted(_losses(straight)) == list(range(1, target + 1))
    assert _losses(out) == _losses(straight)


def test_a_second_ctrl_c_aborts_and_harms_no_checkpoint(corpus, tmp_path):
    out = tmp_path / "run"
    proc = _start(corpus, out, "--ckpt-every", "1")
    _wait_for_steps(proc, out, 3)
    while proc.poll() is None:  # Ctrl-C, then again and again until it stops
        proc.send_signal(signal.SIGINT)
        time.sleep(0.02)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and err.count("error: interrupted") == 1, err[-3000:]
    assert not [x for x in err.splitlines() if x.startswith("interrupted by")], err[-3000:]
    steps = checkpoint.all_steps(out)
    finished = [s for s in steps if (checkpoint.checkpoint_dir(out) / str(s) / checkpoint.FILE_DIGESTS).exists()]
    # every finished checkpoint verifies; only the save in flight may be unfinished (then
    # the resume sets it aside as a save that did not finish)
    assert finished and steps[:-1] == finished[: len(steps) - 1], steps
    for step in finished:
        checkpoint.read_meta(out, step)
        checkpoint.verify_files(step, checkpoint.checkpoint_dir(out) / str(step))
    assert main(_argv(corpus, out, max(checkpoint.all_steps(out)) + 1, "--resume")) == 0


@pytest.fixture(scope="module")
def tiny_run(corpus, tmp_path_factory):
    """A one-step run folder with a checkpoint, for generate."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    assert main(_argv(corpus, out, 1)) == 0
    return out


@pytest.mark.parametrize("argv", [
    ["bench", "--preset", "loopos"],
    ["compare-grads", "--preset", "loopos"],
    ["prepare", "--corpus", "stdlib", "--tokenizer", "bpe", "--vocab-size", "4096", "--out", "{tmp}/data"],
    ["generate", "--run", "{run}", "--prompt", "the ", "--num-samples", "64"],
], ids=lambda argv: argv[0])
def test_ctrl_c_stops_any_command_with_one_line_and_130(tmp_path, argv, request):
    if "{run}" in argv:
        argv = [a.replace("{run}", str(request.getfixturevalue("tiny_run"))) for a in argv]
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    # the `jaxformer` console script, with a line once the imports are done
    script = ("import sys; from jaxformer.cli.main import main; print('imported', file=sys.stderr, "
              f"flush=True); sys.argv[1:] = {argv!r}; sys.exit(main())")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=tmp_path)
    assert proc.stderr.readline().strip() == "imported"
    # inside the command's work (each takes far longer; generate restores and compiles first)
    time.sleep(0.5 if argv[0] == "generate" else 2)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == "error: interrupted", err[-3000:]
    assert err.count("error: interrupted") == 1 and "Traceback" not in err, err[-3000:]
