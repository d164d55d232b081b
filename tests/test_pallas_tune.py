"""pallas_tune: the GPU launch chosen by measurement, cached per device kind and shape in
memory and on disk; tested with a fake timer (it never times anything off a GPU)."""

import json

import jax.numpy as jnp
import pytest

from jaxformer.kernels.pallas import forward as pa
from jaxformer.kernels.pallas import backward as pb
from jaxformer.kernels.pallas import tune

SHAPE = tune.Shape(T=1024, Dh=64, dtype="bfloat16", causal=True, G=2)
NAME = tune.key("NVIDIA H100 80GB HBM3", SHAPE)


class FakeTimer:
    """Seconds per candidate from a table; counts its calls; None in the table raises."""
    def __init__(self, table):
        self.table, self.calls = table, []

    def __call__(self, choice):
        self.calls.append(choice)
        if self.table[choice] is None:
            raise RuntimeError("out of shared memory")
        return self.table[choice]


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "_memory", {})
    return tmp_path / "jaxformer" / "pallas_tune.json"


def test_the_fastest_candidate_wins_and_failures_are_skipped(fresh):
    cands = tune.CANDIDATES[:3]
    timer = FakeTimer({cands[0]: 2.0, cands[1]: None, cands[2]: 1.0})
    assert tune.choose(NAME, timer, cands, fresh) == cands[2]
    assert timer.calls == list(cands)


def test_the_choice_is_cached_in_memory_and_on_disk(fresh, monkeypatch):
    cands = tune.CANDIDATES[:2]
    timer = FakeTimer({cands[0]: 1.0, cands[1]: 3.0})
    tune.choose(NAME, timer, cands, fresh)
    assert json.loads(fresh.read_text()) == {NAME: cands[0]._asdict()}
    assert tune.choose(NAME, timer, cands, fresh) == cands[0] and len(timer.calls) == 2  # memory
    monkeypatch.setattr(tune, "_memory", {})  # a new process: read back from disk, not timed
    assert tune.choose(NAME, timer, cands, fresh) == cands[0] and len(timer.calls) == 2
    other = tune.key("NVIDIA A100", SHAPE)  # another device kind: its own entry, timed
    tune.choose(other, FakeTimer({cands[0]: 5.0, cands[1]: 4.0}), cands, fresh)
    assert json.loads(fresh.read_text())[other] == cands[1]._asdict() and NAME in json.loads(fresh.read_text())
    assert not list(fresh.parent.glob("*.tmp"))  # the atomic write left no temp file


def test_a_torn_cache_file_is_tuned_again(fresh):
    fresh.parent.mkdir(parents=True)
    fresh.write_text('{"half')
    cands = tune.CANDIDATES[:1]
    assert tune.choose(NAME, FakeTimer({cands[0]: 1.0}), cands, fresh) == cands[0]


def test_no_candidate_running_is_an_error(fresh):
    with pytest.raises(ValueError, match="no candidate launch ran"):
        tune.choose(NAME, FakeTimer({c: None for c in tune.CANDIDATES}), tune.CANDIDATES, fresh)


def test_the_key_names_every_part_of_the_shape():
    assert NAME == "NVIDIA H100 80GB HBM3|T=1024|Dh=64|bfloat16|causal|G=2"


def test_it_never_runs_off_a_gpu(monkeypatch):
    """On CPU (this test) choice is None without timing; plan takes the defaults."""
    assert tune.choice(SHAPE, measure=lambda *a: pytest.fail("timed off a GPU")) is None
    assert tune.choice(SHAPE) is None
    t, how = pa.plan("gpu", SHAPE, 0, 0)
    assert (t.Kq, t.Kk, how.num_warps, how.num_stages) == (64, 64, 4, 2)


def test_plan_takes_the_tuned_choice_on_a_gpu_and_config_blocks_win(monkeypatch):
    picked = tune.Choice(128, 32, 8, 3)
    monkeypatch.setattr(tune, "choice", lambda shape: picked)
    t, how = pa.plan("gpu", SHAPE, 0, 0)
    assert (t.Kq, t.Kk, how.num_warps, how.num_stages) == (128, 32, 8, 3)
    t, how = pa.plan("gpu", SHAPE, 32, 0)  # ModelConfig.pallas_block_q set: no tuning
    assert (t.Kq, t.Kk, how.num_warps) == (32, 64, 4)
    for device in ("tpu", "cpu"):  # never asked off the GPU branch
        assert pa.plan(device, SHAPE, 0, 0)[0][1:3] == (128, 128)


def test_cache_path_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tune.cache_path() == tmp_path / "jaxformer" / "pallas_tune.json"


def test_the_differentiable_kernel_tunes_its_shape_with_the_kernels_timer(monkeypatch):
    """flash_core_fwd asks for a tuned launch of its own shape, passing the timer of the
    module that owns the kernels; blocks set in the config skip the tuning."""
    asked = []
    monkeypatch.setattr(tune, "choice", lambda shape, measure=None: asked.append((shape, measure)))
    q, k = jnp.zeros((1, 4, 24, 8), jnp.float32), jnp.zeros((1, 2, 24, 8), jnp.float32)
    pb.flash_core_fwd(q, k, k, True)
    assert tune.Shape(24, 8, "float32", True, 2) in [s for s, m in asked if m is pb.time_on_gpu]
    asked.clear()
    pb.flash_core_fwd(q, k, k, True, 8, 8)
    assert all(m is None for _, m in asked)
