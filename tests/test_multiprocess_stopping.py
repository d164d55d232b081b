"""Two processes on localhost as one job (jax.distributed over gloo, as in
test_multiprocess.py), stopped safely: a Ctrl-C to one process makes both checkpoint
the same step through JAX's preemption sync point; a lost process stops the other in
bounded time with one line, and a plain --resume of the same command continues."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import host_devices_flags

from jaxformer.checkpoints import checkpoint
from jaxformer.checkpoints.errors import CheckpointWriteError
from jaxformer.training import liveness

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(corpus, out, steps, *extra):
    return [sys.executable, "-m", "jaxformer", "train", "--preset", "tiny", "--corpus", corpus,
            "--steps", str(steps), "--log-every", "1", "--eval-every", "0", "--no-progress",
            "--out", str(out), *extra]


def _start(command, port):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=host_devices_flags(1),
               JAX_DISABLE_MOST_OPTIMIZATIONS="true", PYTHONPATH=str(ROOT),
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2")
    return [subprocess.Popen(command, env=dict(env, JAX_PROCESS_ID=str(i)), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(2)]


def _wait_for_steps(procs, out, n, timeout=240):
    metrics = Path(out) / "metrics.jsonl"
    t0 = time.time()
    while time.time() - t0 < timeout:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        for p in procs:
            assert p.poll() is None, p.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {n} steps in {timeout} s")


def _finish(procs, timeout=180):
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return [err for _, err in outputs]


@pytest.mark.slow
def test_a_ctrl_c_to_one_process_checkpoints_the_same_step_in_all(corpus, tmp_path):
    out = tmp_path / "run"
    procs = _start(_command(corpus, out, 100000, "--ckpt-every", "0"), _free_port())
    _wait_for_steps(procs, out, 3)
    procs[1].send_signal(signal.SIGINT)
    errs = _finish(procs)
    assert [p.returncode for p in procs] == [143, 130], [e[-2000:] for e in errs]
    lines = [[x for x in err.splitlines() if x.startswith("interrupted")] for err in errs]
    assert [len(x) for x in lines] == [1, 1], errs
    assert all("Traceback" not in err and "preemption sync point" not in err for err in errs), errs
    assert lines[1][0].startswith("interrupted by SIGINT at step "), lines
    assert lines[0][0].startswith("interrupted by a stop notice (SIGTERM or Ctrl-C to a process "
                                  "of this job) at step "), lines
    steps = [int(x[0].split(" at step ")[1].split(";")[0]) for x in lines]
    assert steps[0] == steps[1] and checkpoint.all_steps(out) == [steps[0]], (steps, lines)
    assert lines[0][0].endswith("--resume") and lines[1][0].endswith("--resume"), lines
    checkpoint.verify_files(steps[0], checkpoint.checkpoint_dir(out) / str(steps[0]))
    # the process that got the Ctrl-C said at once what follows; the other had nothing to hear
    assert "Ctrl-C heard: stopping after the step in flight and saving a checkpoint; every process of " \
           "the job stops at the same step" in errs[1], errs[1][-2000:]
    assert " heard: " not in errs[0], errs[0][-2000:]


@pytest.mark.slow
def test_a_lost_process_stops_the_other_with_one_line_and_resume_continues(corpus, tmp_path):
    out = tmp_path / "run"
    command = _command(corpus, out, 100000, "--ckpt-every", "2", "--heartbeat-timeout", "5")
    procs = _start(command, _free_port())
    _wait_for_steps(procs, out, 4)
    t0 = time.time()  # a finished checkpoint to resume from (the loss may come mid-save)
    while not list(checkpoint.checkpoint_dir(out).glob(f"*/{checkpoint.FILE_DIGESTS}")):
        assert time.time() - t0 < 120 and procs[0].poll() is None, "no finished checkpoint"
        time.sleep(0.2)
    lost = time.time()
    procs[1].kill()  # SIGKILL: no handler runs, as when a machine goes away
    errs = _finish(procs, timeout=60)
    stopped_in = time.time() - lost
    assert procs[0].returncode == 75, errs[0][-3000:]
    assert stopped_in < 5 + 20, stopped_in  # the heartbeat timeout and a busy machine's slack
    lines = [x for x in errs[0].splitlines() if x.startswith("error:")]
    assert len(lines) == 1, errs[0][-3000:]
    assert lines[0].startswith("error: lost process 1 of 2 (no heartbeat for 5 s, or it exited); this "
                               "process stops too; resume every process with: jaxformer train "), lines
    assert lines[0].endswith("--resume") and "Traceback" not in errs[0], errs[0][-3000:]
    assert "stack trace" not in errs[0], errs[0][-3000:]
    saved = max(int(p.parent.name) for p in checkpoint.checkpoint_dir(out).glob(f"*/{checkpoint.FILE_DIGESTS}"))
    # a newer checkpoint without its digests (a save cut short), always: the resume sets it
    # aside, once, from one process, while the other waits (both moving it raced)
    fake = checkpoint.checkpoint_dir(out) / str(saved + 1000)
    shutil.copytree(checkpoint.checkpoint_dir(out) / str(saved), fake)
    (fake / checkpoint.FILE_DIGESTS).unlink()
    newer = [s for s in checkpoint.all_steps(out) if s > saved]
    # the same command with --resume: both processes continue from the newest checkpoint
    # (stopped again with a Ctrl-C once they have)
    metrics = Path(out) / "metrics.jsonl"
    reached = len(metrics.read_text().splitlines())  # the records past the checkpoint are redone
    procs = _start(command + ["--resume"], _free_port())
    _wait_for_steps(procs, out, reached + 1)
    procs[0].send_signal(signal.SIGINT)
    errs = _finish(procs)
    assert [p.returncode for p in procs] == [130, 143], [e[-2000:] for e in errs]
    assert f"resuming from checkpoint step {saved} " in errs[0], errs[0][-3000:]
    moved = [x for x in errs[0].splitlines() if x.startswith("moved the damaged checkpoint")]
    assert [int(x.split()[6]) for x in moved] == newer, errs[0][-3000:]
    assert "moved the damaged" not in errs[1] and "No such file" not in errs[1], errs[1][-3000:]
    assert sorted(p.name for p in (Path(out) / "damaged_checkpoints").iterdir()) == sorted(map(str, newer))
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= saved + 2, steps


def test_a_save_that_lost_its_peer_counts_as_a_lost_peer():
    """A checkpoint save fails when its all-gather loses the peer mid-save: the train
    command must wait for the liveness verdict then, not report the save."""
    gloo = ValueError("UNKNOWN: Gloo AllGather failed: Connection reset by peer")
    save = CheckpointWriteError("cannot write checkpoint step 4 to run/checkpoints: ValueError: UNKNOWN: ...")
    save.__cause__ = gloo
    assert liveness.may_be_a_lost_peer(gloo) and liveness.may_be_a_lost_peer(save)
    assert not liveness.may_be_a_lost_peer(CheckpointWriteError("cannot write checkpoint: disk full"))
    assert not liveness.may_be_a_lost_peer(ValueError("bad shape"))
