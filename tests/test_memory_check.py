"""The memory check before the first step: XLA's plan of the compiled train step
against the device's free memory, and the one error that names the options."""

import pytest
from helpers import tiny_settings

from jaxformer.model.config import PRESETS
from jaxformer.observe.words import format_bytes, plural, verb
from jaxformer.training import memory_check
from jaxformer.training.loop import train
from jaxformer.training.memory_check import MemoryCheckError, MemoryPlan


def test_plan_total_counts_donated_buffers_once():
    plan = MemoryPlan(temp=40, argument=100, output=90, alias=80)
    assert plan.total == 150
    assert plan.half_batch() == 130


def test_a_host_needs_room_beyond_the_plan(monkeypatch):
    """On a CPU host the step must fit with HOST_MARGIN and HOST_SLACK to spare (a plan
    that just fitted the free RAM was killed for memory); an accelerator's plan is exact."""
    class Device:
        def __init__(self, platform):
            self.platform = platform

    plan = MemoryPlan(temp=9 * 2**30, argument=2**30, output=0)
    cpu = memory_check.needed(plan.total, Device("cpu"))
    assert cpu == int(plan.total * (1 + memory_check.HOST_MARGIN)) + memory_check.HOST_SLACK
    assert memory_check.needed(plan.total, Device("gpu")) == plan.total
    config = PRESETS["tiny"]
    monkeypatch.setattr(memory_check, "available", lambda device: (cpu, "test memory"))
    assert memory_check.check_memory(lambda c: plan, config, 8, 1, Device("cpu")) == plan
    monkeypatch.setattr(memory_check, "available", lambda device: (plan.total + 2**20, "test memory"))
    assert memory_check.check_memory(lambda c: plan, config, 8, 1, Device("gpu")) == plan
    with pytest.raises(MemoryCheckError, match=r"needs 10.0 GiB .*to spare for the rest of the process: "
                                               r"12.0 GiB\) and 10.0 GiB is test memory"):
        memory_check.check_memory(lambda c: plan, config, 8, 1, Device("cpu"))


def test_refused_before_any_state_or_folder(corpus, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(memory_check, "available", lambda device: (1000, "test memory"))
    lines = []
    with pytest.raises(MemoryCheckError) as e:
        train(tiny_settings(corpus, steps=3), tmp_path / "run", progress=False, log=lines.append)
    msg = str(e.value)
    assert "1000 B is test memory" in msg
    assert "--attention-impl blockwise --loss-chunk 256 --remat block:" in msg and "(compiled)" in msg
    assert "--batch-size 4 --accum-steps 2 (the same tokens per update)" in msg
    assert "--ignore-memory-check" in msg
    assert "compiling the train step for this shape..." in lines
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # trying anyway trains
    result = train(tiny_settings(corpus, steps=3), tmp_path / "run", progress=False,
                   check_memory=False)
    assert result.records[-1]["step"] == 3


def test_the_check_passes_and_says_the_need(corpus, tmp_path):  # noqa: F811
    lines = []
    train(tiny_settings(corpus, steps=2), tmp_path / "ok", progress=False, log=lines.append)
    need = [line for line in lines if line.startswith("compiled in")]
    assert len(need) == 1 and "per device of" in need[0], lines


def test_words():
    assert plural(1, "step") == "1 step" and plural(2, "step") == "2 steps"
    assert plural(0, "process") == "0 processes" and plural(1200, "token") == "1,200 tokens"
    assert verb(1, "is") == "is" and verb(3, "is") == "are"
    assert format_bytes(512) == "512 B" and format_bytes(3 * 1024 ** 3) == "3.0 GiB"
    assert format_bytes(5 * 1024 ** 4) == "5120.0 GiB"


def test_fresh_run_clears_a_killed_runs_leftovers(corpus, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.out.tfevents.1.old").write_bytes(b"x")
    (run / "metrics.jsonl").write_text('{"step": 99, "loss": 1.0}\n')
    lines = []
    train(tiny_settings(corpus, steps=2), run, progress=False, log=lines.append)
    assert not (run / "events.out.tfevents.1.old").exists()
    assert any("removed the earlier run's metrics.jsonl and 1 TensorBoard event file" in line
               for line in lines), lines


def test_float16_compute_refused_before_any_data(tmp_path):
    from jaxformer.training.settings import settings_for
    with pytest.raises(ValueError, match="float16"):
        settings_for("tiny", corpus=str(tmp_path / "missing.txt"),
                     model={"compute_dtype": "float16"}).validate()
