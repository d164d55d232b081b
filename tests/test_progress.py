"""Honest feedback from a training run: the bar says "compiling" (no rate) until the first
step finished and then counts finished steps only; at most two steps are in flight; a
Ctrl-C is acknowledged while the step in flight still runs, the run stops after it and its
checkpoint verifies."""

import hashlib
import io
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import pytest
from helpers import tiny_settings

from jaxformer.checkpoints import checkpoint
from jaxformer.observe import report, run_log
from jaxformer.training import loop, stopping
from jaxformer.training.stopping import Interrupted, StopRequests, notice


def test_the_bar_says_compiling_until_a_step_finished_then_shows_a_rate():
    out = io.StringIO()
    bar = report.Progress(10, 40, True, file=out)
    bar.set_postfix(loss="5.0")  # the first record's: no speed
    shown = out.getvalue()
    assert "10/40 [compiling]" in shown and "step/s" not in shown and "loss" not in shown, shown
    bar.finished(11)
    bar.finished(11)  # already counted
    bar.finished(9)
    assert "11/40" in out.getvalue().split("compiling]")[-1] and bar.done == 11
    time.sleep(0.15)  # past tqdm's mininterval
    bar.finished(14)
    last = out.getvalue().split("\r")[-1]
    assert "14/40" in last and "step/s" in last and "?step/s" not in last and "loss=5.0" in last, last
    bar.close()


@jax.jit
def _busy(metrics, reps):
    """metrics unchanged, ready only after ``reps`` (128, 128) products that depend on them."""
    x = jnp.full((128, 128), metrics["loss"] / 128)
    x = jax.lax.fori_loop(0, reps, lambda i, x: jnp.tanh(x @ x), x)
    return {**metrics, "loss": metrics["loss"] + 0 * x[0, 0]}


def test_the_bar_counts_finished_steps_and_ctrl_c_is_heard_while_a_step_runs(corpus, tmp_path, monkeypatch):
    """Every step takes tens of ms and step SLOW about a second (device work: dispatch
    returns at once); a SIGINT arrives while the loop waits on step SLOW, with SLOW + 1
    dispatched. Python runs its signal handlers only when the main thread is back in the
    interpreter, so the line must come from elsewhere to come at once."""
    SLOW = 4
    outputs, in_flight, sent = [], [], []  # each step's metrics; not-ready steps at each dispatch
    real_step = loop.compiled_step

    def slowed(spec):
        step = real_step(spec)

        def run(state, batch):
            in_flight.append(sum(not m["loss"].is_ready() for m in outputs))
            state, metrics = step(state, batch)
            metrics = _busy(metrics, 2500 if len(outputs) + 1 == SLOW else 30)
            outputs.append(metrics)
            if len(outputs) == SLOW + 1:  # the main thread now waits on step SLOW, in the runtime
                def kill():
                    sent.append(time.perf_counter())
                    os.kill(os.getpid(), signal.SIGINT)
                threading.Timer(0.1, kill).start()
            return state, metrics
        return run

    counted = []  # (step the bar counts, every step up to it finished)
    real_finished = report.Progress.finished

    def finished(self, step):
        counted.append((step, all(m["loss"].is_ready() for m in outputs[:step])))
        real_finished(self, step)

    heard = []  # (time, line, whether step SLOW had finished)
    monkeypatch.setattr(loop, "compiled_step", slowed)
    monkeypatch.setattr(run_log.RunLog, "_plot", lambda self: None)  # the plots are test_train's
    monkeypatch.setattr(report.Progress, "finished", finished)
    monkeypatch.setattr(stopping, "say", lambda line: heard.append(
        (time.perf_counter(), line, outputs[SLOW - 1]["loss"].is_ready())))
    out = tmp_path / "run"
    with pytest.raises(Interrupted) as stopped:
        loop.train(tiny_settings(corpus, steps=40, log_every=1000, eval_every=0), out, check_memory=False)
    e = stopped.value
    # the Ctrl-C heard while step SLOW still ran, once, and what follows said
    assert len(heard) == 1 and heard[0][1].startswith("Ctrl-C heard: stopping after the step in flight "
                                                      "and saving a checkpoint"), heard
    assert heard[0][2] is False and heard[0][0] - sent[0] < 0.5, (heard, sent)
    # stopped within one step: no step dispatched after the one in flight when the handler ran
    assert e.signum == signal.SIGINT and e.step == SLOW + 1 and len(outputs) == e.step, (e, len(outputs))
    # the bar never counted a step that had not finished; never more than two steps in flight
    assert counted and all(ready for _, ready in counted), counted
    assert max(s for s, _ in counted) == e.step
    assert max(in_flight) <= 1, in_flight
    # the step reached is checkpointed, and the checkpoint verifies
    assert e.saved_now and checkpoint.all_steps(out) == [e.step]
    checkpoint.read_meta(out, e.step)
    checkpoint.verify_files(e.step, checkpoint.checkpoint_dir(out) / str(e.step))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers put back
    assert signal.set_wakeup_fd(-1) == -1


def test_a_stop_signal_is_acknowledged_while_the_main_thread_is_in_native_code(monkeypatch):
    """Python runs a signal handler only when the main thread is back in the interpreter
    (not inside a compile, or a hash of 500 MB here): the line comes at once all the same."""
    heard = []
    monkeypatch.setattr(stopping, "say", lambda line: heard.append((time.perf_counter(), line)))
    zeros = bytes(500_000_000)  # never written: the pages stay the kernel's shared zero page
    with StopRequests() as stops:
        threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGINT)).start()
        hashlib.sha256(zeros).digest()  # one native call, the GIL released
        returned = time.perf_counter()
        assert stops.signum == signal.SIGINT and stops.requested(1)
    assert len(heard) == 1 and heard[0][0] < returned - 0.1, (heard, returned)  # not just as it returned
    assert heard[0][1] == notice(signal.SIGINT, 1)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and signal.set_wakeup_fd(-1) == -1
    assert notice(signal.SIGTERM, 1, multi=True) == ("SIGTERM heard: stopping after the step in flight and "
                                                     "saving a checkpoint; every process of the job stops "
                                                     "at the same step")
    assert notice(signal.SIGINT, 2).startswith("Ctrl-C again: quitting")
    assert notice(signal.SIGTERM, 2) is None and notice(signal.SIGINT, 3) is None
