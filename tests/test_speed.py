"""Honest speed: the CPU peak measured once per machine (cached) and outside every
timed window; the steady-state figure made of step times alone."""

import json
import statistics
import time

import pytest
from helpers import tiny_settings

from jaxformer.observe import flops, run_log
from jaxformer.training.loop import train


@pytest.fixture
def peak_cache(tmp_path, monkeypatch):
    """The CPU peak's cache under tmp_path, emptied before and after, the machine quiet; the
    test sets what cpu_matmul_flops measures."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(flops, "machine_is_busy", lambda: False)
    flops.measure_cpu_peak.cache_clear()
    yield tmp_path / "jaxformer" / "peak.json"
    flops.measure_cpu_peak.cache_clear()


def test_cpu_peak_is_measured_once_per_machine(peak_cache, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(flops, "cpu_matmul_flops", lambda n, reps=10: calls.append(n) or 123e9)
    assert flops.measure_cpu_peak(64) == 123e9
    flops.measure_cpu_peak.cache_clear()  # a new process
    assert flops.measure_cpu_peak(64) == 123e9
    assert calls == [64]
    saved = json.loads(peak_cache.read_text())
    assert list(saved.values()) == [123e9] and "cores" in next(iter(saved))
    peak, source = flops.device_peak(cpu_matmul=64)
    assert peak == 123e9 and "cached in" in source and str(tmp_path) in source


def test_a_peak_measured_on_a_busy_machine_is_not_cached(peak_cache, monkeypatch):
    calls = []
    monkeypatch.setattr(flops, "cpu_matmul_flops", lambda n, reps=10: calls.append(n) or 8e9)
    monkeypatch.setattr(flops, "machine_is_busy", lambda: True)
    assert flops.measure_cpu_peak(64) == 8e9
    assert not peak_cache.exists()
    flops.measure_cpu_peak.cache_clear()  # a new process on a quiet machine measures again
    monkeypatch.setattr(flops, "machine_is_busy", lambda: False)
    assert flops.measure_cpu_peak(64) == 8e9 and calls == [64, 64]
    assert peak_cache.exists()


def test_an_impossible_cpu_peak_is_neither_cached_nor_used(peak_cache, monkeypatch):
    """A matmul "measured" faster than any CPU runs one (or such a figure left in the
    cache) is dropped: measured again, and with no plausible figure MFU is n/a."""
    impossible = flops.CPU_CORE_CEILING * (flops.os.cpu_count() or 1) * 2
    figures = [impossible, impossible, impossible, 90e9]
    monkeypatch.setattr(flops, "cpu_matmul_flops", lambda n, reps=10: figures.pop(0))
    peak, source = flops.device_peak(cpu_matmul=64)
    assert peak is None and "faster than any CPU" in source
    assert not peak_cache.exists()
    flops.measure_cpu_peak.cache_clear()  # a new process: one more bad figure, then a good one
    assert flops.measure_cpu_peak(64) == 90e9 and figures == []
    peak_cache.write_text(json.dumps({flops.cpu_key(64): impossible}))  # left by an older version
    flops.measure_cpu_peak.cache_clear()
    figures.append(80e9)
    assert flops.measure_cpu_peak(64) == 80e9
    assert json.loads(peak_cache.read_text()) == {flops.cpu_key(64): 80e9}


def test_steady_state_counts_step_times_only(corpus, tmp_path, monkeypatch):  # noqa: F811
    """Writing a record (slowed here to 50 ms) is not step time: the steady figure
    stays near the logged per-interval speeds, and the peak is named in the log."""
    slow_write = run_log.write_record

    def write_record(path, record):
        time.sleep(0.05)
        slow_write(path, record)

    monkeypatch.setattr(run_log, "write_record", write_record)
    lines = []
    result = train(tiny_settings(corpus, steps=20, log_every=1, eval_every=0), tmp_path / "run",
                   progress=False, log=lines.append)
    t = result.timing
    assert t["steady_steps"] == 19
    assert t["steady_s"] < 19 * 0.05, t  # the 19 writes' sleeps (0.95 s) are not in it
    logged = statistics.median(r["tokens_per_s"] for r in result.records[1:])
    assert abs(t["steady_tokens_per_s"] - logged) < 0.3 * logged, (t, logged)
    assert any(line.startswith("MFU against a peak of") for line in lines), lines
