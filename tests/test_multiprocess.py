"""Two processes on localhost as one job (jax.distributed over gloo, four CPU devices
each, a tensor x context step: the mesh fsdp=2 x tensor=2 x context=2, the parameters
split over both processes along fsdp, each process's four devices one tensor x context
group, the blocks tensor parallel with ring attention): the training losses equal one
process's, only process 0 writes the run's records, and the checkpoint restores in one
process."""

import os
import socket
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.checkpoints import checkpoint
from jaxformer.model.transformer import loss_fn
from jaxformer.observe.metrics import read_metrics
from jaxformer.training.loop import train
from helpers import host_devices_flags, tiny_settings

STEPS = 3
MESH = "fsdp=2,tensor=2,context=2"  # fsdp across the processes; tensor x context inside each


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(corpus, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=host_devices_flags(4),
               JAX_DISABLE_MOST_OPTIMIZATIONS="true", JAX_ENABLE_X64="true",  # as in the test process
               JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}", JAX_NUM_PROCESSES="2")
    out = tmp_path / "two"
    command = [sys.executable, "-m", "jaxformer.cli.main", "train", "--preset", "tiny", "--corpus", corpus,
               "--steps", str(STEPS), "--log-every", "1", "--eval-every", str(STEPS), "--eval-batches", "2",
               "--ckpt-every", "0", "--mesh", MESH, "--no-progress", "--out", str(out)]
    procs = [subprocess.Popen(command, env=dict(env, JAX_PROCESS_ID=str(i)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=600) for p in procs]
    for p, (stdout, stderr) in zip(procs, outputs):
        assert p.returncode == 0, stderr[-3000:]
    assert "8 cpu devices in 2 processes" in outputs[0][1]
    assert "run folder" in outputs[0][0] and "run folder" not in outputs[1][0]  # only process 0 reports
    two = read_metrics(out)
    one = train(tiny_settings(corpus, steps=STEPS, eval_every=STEPS), tmp_path / "one", progress=False)
    single = one.records
    assert [r["step"] for r in two] == [r["step"] for r in single] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "update_norm", "val_loss"):
        a = [r[key] for r in single if key in r]
        b = [r[key] for r in two if key in r]
        assert len(a) == len(b) > 0
        np.testing.assert_allclose(b, a, rtol=2e-5, err_msg=key)  # float32 round-off
    assert checkpoint.all_steps(out) == [STEPS]
    assert checkpoint.read_meta(out)["settings"]["mesh"] == MESH
    # the shards both processes wrote make one state, which one process reads back
    # (compared through the loss: leaves whose gradient is round-off, such as the key
    # bias, which softmax ignores, differ at the level of Adam's eps)
    restored = checkpoint.restore(out, one.state)
    assert int(restored.step) == STEPS and int(restored.data_index) == STEPS
    batch = {"inputs": jnp.arange(32, dtype=jnp.int32).reshape(2, 16) % 200}
    batch["targets"] = (batch["inputs"] + 1) % 200
    losses = [float(loss_fn(state.params, batch, one.config)) for state in (restored, one.state)]
    np.testing.assert_allclose(losses[0], losses[1], rtol=2e-5)
