"""jaxformer.memory at a tiny shape: the structure of its figures (no timing assertions)."""

from jaxformer.tools import memory


def test_memory_report_structure():
    config = memory.memory_config(seq_len=8, d_model=8, n_heads=2, n_layers=1, vocab_size=11,
                                  attention_block=4)
    report = memory.memory_report(config, batch_size=2, seq_len=8, long_seq_len=16, loss_chunk=4,
                                  rounds=1)
    assert set(report.memory) == {8, 16}
    for stats in report.memory.values():
        assert set(stats) == set(memory.SOURCES)
        assert all(m.argument_bytes > 0 and m.temp_bytes >= 0 for m in stats.values())
    assert report.lean_vs_autodiff > 0 and set(report.growth) == set(memory.SOURCES)
    assert set(report.step_seconds) == {"manual", "lean"} and report.lean_vs_manual_time > 0
    assert len(report.loadavg) == 3
    text = memory.format_report(report, 8, 16)
    assert "(a)" in text and "(b)" in text and "(c)" in text

