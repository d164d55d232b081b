"""The benchmark's report structure, FLOP counting and errors (never its timings)."""

import json
import types

import pytest

from jaxformer.cli.bench import main
from jaxformer.cli.main import main as cli_main
from jaxformer.model.config import get_preset
from jaxformer.observe import flops
from jaxformer.tools.bench_report import format_markdown


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert main(["--quick", "--depths", "1,2", "--out", str(out)]) == 0
    return out, json.loads((out / "report.json").read_text())


def test_quick_run_writes_the_three_reports(quick_report):
    out, report = quick_report
    assert (out / "report.md").read_text().startswith("# Training-step benchmark: L2 D16")
    assert (out / "bench.png").stat().st_size > 0
    assert {"machine", "shape", "settings", "flops", "peak", "contestants", "grad_fns", "ratios",
            "targets", "notes"} <= set(report)
    assert len(report["machine"]["loadavg_before"]) == 3 and report["machine"]["platform"]
    assert report["shape"]["tokens_per_step"] == 2 * 8
    assert report["settings"]["rounds"] == 1


def test_each_contestant_has_consistent_figures(quick_report):
    _, report = quick_report
    assert {"manual", "auto"} <= set(report["contestants"])
    assert "torch_compile" not in report["contestants"]  # --quick skips torch.compile
    for name, r in report["contestants"].items():
        assert r["error"] is None, (name, r["error"])
        ms, tok = r["ms_per_step"], r["tokens_per_s"]
        assert ms["min"] <= ms["median"] <= ms["max"] and len(r["samples_ms"]) == 1
        assert tok["median"] == pytest.approx(16 / (ms["median"] / 1e3))
        assert r["model_flops_per_s"] == pytest.approx(tok["median"] * report["flops"]["per_token"])
        assert r["mfu"] == pytest.approx(r["model_flops_per_s"] / report["peak"]["flops_per_s"])
    ratio = report["ratios"]["manual_over_auto_step_time"]  # one round: that round's ratio
    expected = report["contestants"]["manual"]["samples_ms"][0] / report["contestants"]["auto"]["samples_ms"][0]
    assert ratio == {"median": pytest.approx(expected), "min": pytest.approx(expected),
                     "max": pytest.approx(expected)}


def test_grad_fns_report_memory_and_compile_time_by_depth(quick_report):
    _, report = quick_report
    for kind in ("manual", "auto"):
        g = report["grad_fns"][kind]
        assert set(g["compile_s_by_depth"]) == {"1", "2"} and g["compile_s"] > 0
        assert g["memory"]["argument_bytes"] > 0


def test_a_failed_contestant_shows_its_error(quick_report):
    _, report = quick_report
    report = dict(report, contestants={**report["contestants"], "torch_compile": {
        "compile_s": None, "error": "BackendCompilerFailed: no C++ compiler"}})
    assert "| PyTorch torch.compile | failed: BackendCompilerFailed: no C++ compiler |" \
        in format_markdown(report)


def test_flops_per_token_convention():
    c = get_preset("tiny")  # L2 D16 F24 V256
    n = 2 * (4 * 16 * 16 + 2 * 16 * 24) + 16 * 256
    assert flops.matmul_params(c) == n
    assert flops.flops_per_token(c, 8) == 6 * n + 12 * 2 * 8 * 16 // 2
    assert flops.flops_per_token(c.replace(causal=False), 8) == 6 * n + 12 * 2 * 8 * 16
    with pytest.raises(ValueError, match="seq_len"):
        flops.flops_per_token(c, 0)


def test_mfu_uses_the_datasheet_peak_of_a_known_gpu():
    c = get_preset("tiny")
    h100 = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    assert flops.mfu(1e6, c, 8, h100) == pytest.approx(1e6 * flops.flops_per_token(c, 8) / 494.7e12)
    bf16 = c.replace(compute_dtype="bfloat16")
    assert flops.mfu(1e6, bf16, 8, h100) == pytest.approx(1e6 * flops.flops_per_token(c, 8) / 989.4e12)
    other = types.SimpleNamespace(platform="gpu", device_kind="Some GPU")
    assert flops.mfu(1e6, c, 8, other) is None and flops.mfu_text(1e6, c, 8, other) == "n/a"


def _error_line(capsys, code):
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("args, message", [
    (["--quick", "--d-model", "15"], "ModelConfig.d_model (15) must be divisible by n_heads"),
    (["--quick", "--seq-len", "99"], "seq_len 99 exceeds max_seq_len 16"),
    (["--quick", "--n-layers", "0"], "ModelConfig.n_layers must be a positive integer"),
    (["--quick", "--rounds", "0"], "expected a positive integer"),
    (["--quick", "--depths", "2"], "expected two positive layer counts"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_input_is_one_error_line(args, message, capsys):
    line = _error_line(capsys, main(args))
    assert message in line, line
    assert message in _error_line(capsys, cli_main(["bench", *args]))
