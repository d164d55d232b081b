"""The Pallas kernels' GPU launch table: chosen by measurement only when tuning is asked
for (kernels/pallas/timing.py: ``jaxformer tune``, ``jaxformer bench``), kept per device
kind and shape in memory and on disk; a traced model only reads it. Tested on CPU with a
fake timer and a stand-in GPU kind (``tune.device_kind``)."""

import json

import jax
import jax.numpy as jnp
import pytest
from helpers import make_batch, make_params

from jaxformer import loss_fn
from jaxformer.cli.main import main
from jaxformer.kernels.pallas import entry
from jaxformer.kernels.pallas import tiling
from jaxformer.kernels.pallas import timing
from jaxformer.kernels.pallas import tune
from jaxformer.model.config import ModelConfig
from jaxformer.tools.bench.run import pallas_shape

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


KIND = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty table: nothing in memory, $XDG_CACHE_HOME in a fresh folder."""
    monkeypatch.setattr(tune, "_memory", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "jaxformer" / "pallas_launches.json"


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


def test_it_never_runs_off_a_gpu(fresh):
    """On CPU (this test) there is no GPU kind: the table is not read, plan takes the
    defaults, and the explicit tune refuses by name."""
    assert tune.device_kind() is None and tune.choice(SHAPE) is None
    t, how = tiling.plan("gpu", SHAPE, 0, 0)
    assert (t.Kq, t.Kk, how.num_warps, how.num_stages) == (64, 64, 4, 2)
    with pytest.raises(ValueError, match="tuning the Pallas kernels times them on a GPU; JAX's backend here "
                                         "is 'cpu'"):
        timing.tune([SHAPE], measure=lambda *a: pytest.fail("timed off a GPU"))
    assert not fresh.parent.exists()


def test_plan_takes_the_tuned_choice_on_a_gpu_and_config_blocks_win(monkeypatch):
    picked = tune.Choice(128, 32, 8, 3)
    monkeypatch.setattr(tune, "choice", lambda shape: picked)
    t, how = tiling.plan("gpu", SHAPE, 0, 0)
    assert (t.Kq, t.Kk, how.num_warps, how.num_stages) == (128, 32, 8, 3)
    t, how = tiling.plan("gpu", SHAPE, 32, 0)  # ModelConfig.pallas_block_q set: no tuning
    assert (t.Kq, t.Kk, how.num_warps) == (32, 64, 4)
    for device in ("tpu", "cpu"):  # never asked off the GPU branch
        assert tiling.plan(device, SHAPE, 0, 0)[0][1:3] == (128, 128)


@pytest.mark.parametrize("T, G", [(1024, 1), (2048, 3), (64, 2), (65536, 1)])
def test_each_candidate_is_timed_on_a_batch_that_fills_the_gpu(T, G):
    """The candidates race on at least TIMED_ROWS query rows x heads (the model's own step
    runs thousands of programs; one sequence of 4 heads ran 64 and ranked the tiles wrong),
    and on no more than one sequence past that."""
    q, k = timing.timed_shapes(tune.Shape(T=T, Dh=64, dtype="bfloat16", causal=True, G=G))
    B, H = q[0], q[1]
    assert (H, k[1]) == (4 * G, 4) and q[2:] == k[2:] == (T, 64) and k[0] == B
    assert B * H * T >= timing.TIMED_ROWS
    assert B == 1 or (B - 1) * H * T < timing.TIMED_ROWS


def test_cache_path_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tune.cache_path() == tmp_path / "jaxformer" / "pallas_launches.json"


CONFIG = ModelConfig(vocab_size=32, d_model=32, n_heads=4, n_kv_heads=2, n_layers=1, d_ff=64, max_seq_len=24,
                     attention_impl="pallas")


def trace_model_grads(config=CONFIG, T=24):
    """The jaxpr of jax.grad of the model's loss, the pallas attention's every platform
    branch traced (the GPU one asks tiling.plan for its launch)."""
    params, batch = make_params(config, jnp.float32), make_batch(config, 2, T, None)
    return jax.make_jaxpr(jax.grad(lambda p: loss_fn(p, batch, config)))(params)


def spy_on_choice(monkeypatch):
    """[(shape, the table's answer)] of every tune.choice a trace makes."""
    asked, read = [], tune.choice
    monkeypatch.setattr(tune, "choice", lambda shape: asked.append((shape, read(shape))) or asked[-1][1])
    return asked


def test_a_traced_model_on_a_gpu_reads_the_table_and_never_times_or_writes(fresh, monkeypatch):
    """On a (stand-in) GPU with an empty table, tracing the model's gradient asks the
    table for its attention's shape, gets nothing (the default tiling), times nothing
    and writes no file."""
    monkeypatch.setattr(tune, "device_kind", lambda: KIND)
    monkeypatch.setattr(tune, "choose", lambda *a, **k: pytest.fail("a trace chose a launch"))
    monkeypatch.setattr(timing, "time_on_gpu", lambda *a, **k: pytest.fail("a trace timed the kernels"))
    asked = spy_on_choice(monkeypatch)
    trace_model_grads()
    assert {shape for shape, _ in asked} == {tune.Shape(24, 8, "float32", True, 2)}
    assert all(answer is None for _, answer in asked)
    assert not fresh.parent.exists()  # not even the folder


def test_the_explicit_tune_writes_the_table_that_a_trace_then_reads(fresh, monkeypatch):
    """timing.tune (what `jaxformer tune` and `jaxformer bench` call) times every candidate
    at the model's shape (bench.run.pallas_shape) and writes the fastest; a trace in a new
    process (memory cleared) reads it from disk for the same shape, and times nothing."""
    monkeypatch.setattr(tune, "device_kind", lambda: KIND)
    fastest = tune.CANDIDATES[5]
    timed = []

    def measure(shape, c):
        timed.append((shape, c))
        return 1.0 if c == fastest else 2.0

    shape = pallas_shape(CONFIG, 24)
    assert timing.tune([shape, shape], measure) == {shape: fastest}
    assert timed == [(shape, c) for c in tune.CANDIDATES]  # the repeated shape timed once
    assert json.loads(fresh.read_text()) == {tune.key(KIND, shape): fastest._asdict()}
    assert timing.tune([shape], measure) == {shape: fastest} and len(timed) == len(tune.CANDIDATES)
    monkeypatch.setattr(tune, "_memory", {})
    monkeypatch.setattr(timing, "time_on_gpu", lambda *a, **k: pytest.fail("a trace timed the kernels"))
    asked = spy_on_choice(monkeypatch)
    trace_model_grads()
    assert {answer for _, answer in asked} == {fastest} and {s for s, _ in asked} == {shape}
    t, how = tiling.plan("gpu", shape, 0, 0)
    assert (t.Kq, t.Kk, how.num_warps, how.num_stages) == (32, 32, 8, 2)  # 128-tiles cut to T = 24's 32
    assert timing.tune([shape], measure, again=True) == {shape: fastest} and len(timed) == 2 * len(tune.CANDIDATES)


def test_the_entry_point_never_asks_to_tune(monkeypatch):
    """flash_core_fwd (the differentiable kernel's forward) reads only: it never calls the
    tuner, with or without block sizes."""
    monkeypatch.setattr(tune, "choose", lambda *a, **k: pytest.fail("the forward tuned"))
    monkeypatch.setattr(tune, "device_kind", lambda: KIND)
    q, k = jnp.zeros((1, 4, 24, 8), jnp.float32), jnp.zeros((1, 2, 24, 8), jnp.float32)
    jax.eval_shape(lambda q, k: entry.flash_core_fwd(q, k, k, True), q, k)


def test_the_tune_command_off_a_gpu_is_one_error_line(capsys, fresh):
    assert main(["tune", "--preset", "loopos"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: tuning the Pallas kernels times them on a GPU") and "\n" not in err
    assert not fresh.parent.exists()


def test_the_tune_command_tunes_the_presets_shape(capsys, fresh, monkeypatch):
    monkeypatch.setattr(tune, "device_kind", lambda: KIND)
    monkeypatch.setattr(timing, "time_on_gpu", lambda shape, c: 1.0 if c == tune.CANDIDATES[2] else 2.0)
    assert main(["tune", "--preset", "gpt2", "--compute-dtype", "bfloat16", "--seq-len", "1024"]) == 0
    name = f"{KIND}|T=1024|Dh=64|bfloat16|causal|G=1"
    assert capsys.readouterr().out.startswith(f"{name}: block_q 128, block_k 64, num_warps 4, num_stages 2 (")
    assert json.loads(fresh.read_text()) == {name: tune.CANDIDATES[2]._asdict()}
