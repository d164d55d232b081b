"""Data parallelism through jax.sharding: 8 host devices give the single-device losses."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxformer.train import train
from test_train import tiny_settings, write_corpus

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    import numpy as np
    jax.config.update("jax_enable_x64", True)  # as in the test process
    from jaxformer.train import make_mesh, put_batch, train
    from test_train import tiny_settings

    corpus, out = sys.argv[1], sys.argv[2]
    assert jax.device_count() == 8, jax.devices()
    batch = put_batch({"inputs": np.zeros((8, 16), np.int32)}, make_mesh())
    assert [s.data.shape for s in batch["inputs"].addressable_shards] == [(1, 16)] * 8
    try:
        train(tiny_settings(corpus, steps=3, batch_size=12), out + "-bad", progress=False)
    except ValueError as e:
        assert "batch_size 12 must be divisible by the number of devices (8)" in str(e), e
    else:
        raise AssertionError("batch_size 12 on 8 devices was accepted")
    result = train(tiny_settings(corpus, steps=3, eval_every=3), out, progress=False)
    assert result.state.params["tok_embed"].sharding.is_fully_replicated
    print(json.dumps(result.records))
""")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "text.txt")


def test_eight_devices_match_one(corpus, tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    # compiled like the rest of the suite (conftest.py): faster, and the same on both sides
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, corpus, str(tmp_path / "sharded")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = json.loads(proc.stdout.strip().splitlines()[-1])
    single = train(tiny_settings(corpus, steps=3, eval_every=3), tmp_path / "single", progress=False,
                   devices=None).records
    assert [r["step"] for r in sharded] == [r["step"] for r in single] == [1, 2, 3]
    for key in ("loss", "grad_norm", "update_norm", "val_loss"):
        a = [r[key] for r in single if key in r]
        b = [r[key] for r in sharded if key in r]
        assert len(a) == len(b) > 0
        np.testing.assert_allclose(b, a, rtol=2e-5, err_msg=key)  # float32 round-off
