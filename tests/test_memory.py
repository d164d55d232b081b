"""jaxformer.tools.memory: the structure of its report at a tiny shape, and XLA's memory
plan at a small one, where each lean option must save temp memory (no timing assertions)."""

import pytest

import manual_grads
from jaxformer.tools import memory

pytestmark = pytest.mark.xdist_group("test_memory")  # one worker: its module fixture (temp_bytes) runs once

# Small, yet each option's saving is plain in the plan: the logits (B, T, V) and the
# attention probabilities (B, H, T, T) per layer both weigh on the peak.
SHAPE = dict(seq_len=64, d_model=16, n_heads=4, n_layers=2, vocab_size=512, attention_block=16)
BATCH, LOSS_CHUNK = 2, 16
LEAN_OPTIONS = {"blockwise": dict(attention_impl="blockwise"), "chunked_loss": dict(loss_chunk=LOSS_CHUNK),
                "remat": dict(remat="block")}
SAVING = 0.9  # each lean option's temp memory at most this fraction of the plain model's


def test_memory_report_structure():
    config = memory.memory_config(seq_len=8, d_model=8, n_heads=2, n_layers=1, vocab_size=11,
                                  attention_block=4)
    report = memory.memory_report(config, batch_size=2, seq_len=8, long_seq_len=16, loss_chunk=4,
                                  rounds=1)
    assert set(report.memory) == {8, 16}
    for stats in report.memory.values():
        assert set(stats) == set(memory.SOURCES)
        assert all(m.argument > 0 and m.temp >= 0 for m in stats.values())
    assert report.lean_vs_autodiff > 0 and set(report.growth) == set(memory.SOURCES)
    assert set(report.step_seconds) == {"manual", "lean"} and report.lean_vs_manual_time > 0
    assert len(report.loadavg) == 3
    text = memory.format_report(report, 8, 16)
    assert "(a)" in text and "(b)" in text and "(c)" in text


@pytest.fixture(scope="module")
def temp_bytes():
    """{name: XLA temp bytes of one gradient at SHAPE}: autodiff and manual of the plain model,
    and the manual gradient with each lean option alone."""
    config = memory.memory_config(**SHAPE)
    stats = memory.measure_memory(config, BATCH, SHAPE["seq_len"], LOSS_CHUNK, sources=("autodiff", "manual"))
    temps = {name: m.temp for name, m in stats.items()}
    args = memory.abstract_inputs(config, BATCH, SHAPE["seq_len"])
    for name, options in LEAN_OPTIONS.items():
        grads = lambda params, batch, cfg=config.replace(**options): manual_grads.value_and_grad(  # noqa: E731
            params, batch, cfg)
        temps[name] = memory.compiled_memory(grads, *args).temp
    return temps


@pytest.mark.parametrize("option", LEAN_OPTIONS)
def test_lean_option_needs_less_temp_memory(temp_bytes, option):
    ratio = temp_bytes[option] / temp_bytes["manual"]
    assert ratio <= SAVING, f"{option}: temp {temp_bytes[option]} B is {ratio:.2f}x the plain model's"


def test_manual_backward_needs_no_more_than_autodiff(temp_bytes):
    assert temp_bytes["manual"] <= temp_bytes["autodiff"], temp_bytes
