"""The benchmark's report structure, contestant selection, skip lines, the shape sweep,
FLOP counting and errors (never its timings). Nothing here needs a GPU: the GPU's
choices are checked with jax.default_backend() mocked."""

import contextlib
import importlib.util
import io
import json
import sys
import types

import jax
import pytest

from jaxformer.cli.bench import build_parser, main, settings_from_args
from jaxformer.cli.main import main as cli_main
from jaxformer.data.batching import random_batch
from jaxformer.model.config import get_preset
from jaxformer.model.lora import LoraConfig
from jaxformer.model.params import init_params
from jaxformer.observe import flops
from jaxformer.observe.run_log import RunLog
from jaxformer.tools.bench import run as bench
from jaxformer.tools.bench import select as bench_select
from jaxformer.tools.bench import sweep as bench_sweep
from jaxformer.tools.bench.contestants import make_contestants
from jaxformer.tools.bench.report import format_markdown
from jaxformer.tools.bench.select import Spec, select
from jaxformer.training.settings import settings_for

pytestmark = pytest.mark.xdist_group("test_bench")  # one worker: its module fixture (quick_run) runs once

HAS_TORCH = importlib.util.find_spec("torch") is not None  # the bench extra; CI installs it
NO_TORCH = "PyTorch is not installed (pip install torch"
JAX_NAMES = ["manual_full", "manual_blockwise", "manual_pallas", "manual_cudnn", "auto_full", "auto_cudnn"]


def run_main(args):
    """(exit code, stderr) of ``jaxformer bench args``."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    return code, err.getvalue()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    code, err = run_main(["--quick", "--depths", "1,2", "--out", str(out)])
    assert code == 0, err
    return out, json.loads((out / "report.json").read_text()), err


@pytest.fixture(scope="module")
def quick_report(quick_run):
    return quick_run[:2]


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
    ran = {n: r for n, r in report["contestants"].items() if r["status"] == "ran"}
    assert {"manual_full", "manual_blockwise", "auto_full"} <= set(ran)
    assert report["contestants"]["torch_compile"]["status"] == "skipped"  # --quick leaves it out
    assert report["fastest"] in ran
    for name, r in ran.items():
        assert r["error"] is None and r["reason"] is None, (name, r["error"])
        ms, tok = r["ms_per_step"], r["tokens_per_s"]
        assert ms["min"] <= ms["median"] <= ms["max"] and len(r["samples_ms"]) == 1
        assert tok["median"] == pytest.approx(16 / (ms["median"] / 1e3))
        assert r["model_flops_per_s"] == pytest.approx(tok["median"] * report["flops"]["per_token"])
        assert r["mfu"] == pytest.approx(r["model_flops_per_s"] / report["peak"]["flops_per_s"])
    ratio = report["ratios"]["manual_over_auto_step_time"]  # one round: that round's ratio
    c = report["contestants"]
    expected = c["manual_full"]["samples_ms"][0] / c["auto_full"]["samples_ms"][0]
    assert ratio == {"median": pytest.approx(expected), "min": pytest.approx(expected),
                     "max": pytest.approx(expected)}


def test_grad_fns_report_memory_and_compile_time_by_depth(quick_report):
    _, report = quick_report
    for kind in ("manual", "auto"):
        g = report["grad_fns"][kind]
        assert set(g["compile_s_by_depth"]) == {"1", "2"} and g["compile_s"] > 0
        assert g["memory"]["argument_bytes"] > 0


def test_report_records_every_contestant_and_why_some_are_skipped(quick_report):
    _, report = quick_report
    c = report["contestants"]
    assert list(c) == JAX_NAMES + ["torch_eager", "torch_compile"]
    assert set(c["manual_pallas"]) == {"status", "reason", "error"}
    assert c["manual_pallas"]["status"] == "skipped" and "interpret mode" in c["manual_pallas"]["reason"]
    assert "only on a GPU" in c["auto_cudnn"]["reason"] and "only on a GPU" in c["manual_cudnn"]["reason"]
    if HAS_TORCH:
        assert c["torch_compile"]["reason"] == "left out (--quick)"
    else:
        assert c["torch_eager"]["reason"].startswith(NO_TORCH), c["torch_eager"]
        assert c["torch_compile"]["reason"].startswith(NO_TORCH), c["torch_compile"]
    for name in ("manual_full", "manual_blockwise", "auto_full"):
        assert c[name]["memory"]["argument_bytes"] > 0 and c[name]["memory"]["temp_bytes"] >= 0
        assert c[name]["grads"] == name.split("_")[0] and c[name]["attention"] == name.split("_")[1]
    assert report["settings"]["attention"] is None
    assert report["settings"]["torch_device"] == ("cpu" if HAS_TORCH else None)
    assert report["settings"]["torch_autocast"] is None
    assert len(report["notes"]) == (4 if HAS_TORCH else 5)  # pallas, cudnn's two, torch (eager, compile)
    md = format_markdown(report)
    assert "| JAX manual, pallas | skipped: left out on cpu by default" in md


def test_skip_lines_on_the_terminal(quick_run):
    *_, err = quick_run
    lines = err.splitlines()
    assert "Traceback" not in err
    assert sum(line.startswith("manual_pallas: skipped: left out on cpu by default") for line in lines) == 1
    assert sum(line.startswith("manual_cudnn, auto_cudnn: skipped: cuDNN's fused attention runs only on a GPU")
               for line in lines) == 1
    if HAS_TORCH:
        assert "torch_compile: skipped: left out (--quick)" in lines
    else:
        assert sum(line.startswith(f"torch_eager, torch_compile: skipped: {NO_TORCH}")
                   for line in lines) == 1, lines


def test_a_failed_contestant_shows_its_error(quick_report):
    _, report = quick_report
    report = dict(report, contestants={**report["contestants"], "torch_compile": {
        "status": "skipped", "reason": "BackendCompilerFailed: no C++ compiler", "error": None}})
    assert "| PyTorch torch.compile, SDPA | skipped: BackendCompilerFailed: no C++ compiler |" \
        in format_markdown(report)


def test_flops_per_token_convention():
    c = get_preset("tiny")  # L2 D16 F24 V256
    n = 2 * (4 * 16 * 16 + 2 * 16 * 24) + 16 * 256
    assert flops.matmul_params(c) == n
    assert flops.flops_per_token(c, 8) == 6 * n + 12 * 2 * 8 * 16 // 2
    assert flops.flops_per_token(c.replace(causal=False), 8) == 6 * n + 12 * 2 * 8 * 16
    with pytest.raises(ValueError, match="seq_len"):
        flops.flops_per_token(c, 0)


def test_matmul_params_of_the_modern_block():
    """SmolLM-135M's shape (grouped-query k and v, three feed-forward weights, tied head): the
    matmul weights are every parameter but the RMS norms' scales."""
    c = get_preset("smollm", vocab_size=49152)
    norms = c.n_layers * 2 * c.d_model + c.d_model
    assert flops.matmul_params(c) == 134_515_008 - norms


def test_moe_flops_count_the_active_experts_by_hand():
    """A mixture of experts counts the weights a token goes through: the router, k of the E
    gated experts, the shared expert and its sigmoid gate."""
    tiny_moe = get_preset("tiny-moe")  # L2 D16 H4 Hkv2 (Dh 4), E4 k2 Fe12, V256, gated experts
    L, D, Dkv, E, k, Fe, V = 2, 16, 8, 4, 2, 12, 256
    attn = 2 * D * D + 2 * D * Dkv  # wq, wo (D, D); wk, wv (D, Hkv Dh)
    active = L * (attn + D * E + k * 3 * D * Fe) + D * V  # router + k gated experts; the head
    assert flops.matmul_params(tiny_moe) == active == 8064
    assert flops.matmul_params(tiny_moe, active=False) == L * (attn + D * E + E * 3 * D * Fe) + D * V
    assert flops.flops_per_token(tiny_moe, 16) == 6 * active + 12 * L * 16 * D // 2
    Fs = 8
    shared = tiny_moe.replace(shared_expert_d_ff=Fs)
    assert flops.matmul_params(shared) == active + L * (3 * D * Fs + D)  # the shared MLP and its sigmoid gate
    assert flops.matmul_params(shared.replace(shared_expert_gate=False)) == active + L * 3 * D * Fs
    report = flops.flops_breakdown(shared, 16)
    assert report["matmul_params"] == active + L * (3 * D * Fs + D)
    assert report["matmul_params_all_experts"] == report["matmul_params"] + L * (E - k) * 3 * D * Fe
    assert "matmul_params_all_experts" not in flops.flops_breakdown(get_preset("llama-tiny"), 16)


def test_lora_flops_count_the_products_a_lora_step_computes_by_hand(tmp_path):
    """A LoRA step computes the forward's 2 N and the dX through every frozen weight (2 N), no
    frozen dW; each adapter's x A and (x A) B forward (2 r (I + O)), their dA, dB and dX twice that."""
    c = get_preset("tiny")  # L2 D16 F24 V256, the plain MLP (in, out)
    L, D, F, V, r, T = 2, 16, 24, 256, 4, 8
    n = L * (4 * D * D + 2 * D * F) + D * V
    attention = 12 * L * T * D // 2
    lora = LoraConfig(rank=r, targets=("q", "v", "o", "in", "gate"))  # no gate here: skipped
    n_lora = L * r * (3 * (D + D) + (D + F))  # wq, wv, wo (D, D); w_in (D, F)
    assert flops.adapter_params(c, lora) == n_lora == 1088
    assert flops.flops_per_token(c, T, lora) == 4 * n + 6 * n_lora + attention == 38_784
    assert flops.flops_per_token(c, T) == 6 * n + attention == 47_616
    report = flops.flops_breakdown(c, T, lora)
    assert (report["lora_4N"], report["adapters_6N_lora"], report["per_token"]) == (4 * n, 6 * n_lora, 38_784)
    # an MoE layer's experts take no adapters, its attention's do (wq: D -> H Dh = 16)
    moe = get_preset("tiny-moe")
    assert flops.adapter_params(moe, LoraConfig(rank=r, targets=("q", "gate"))) == L * r * (D + 16)
    # a LoRA run's MFU divides this count, not 6 N
    settings = settings_for("tiny", lora_rank=r, lora_targets="q,v,o,in", seq_len=T)
    run_log = RunLog(tmp_path, settings, c, 1, 0, resumed=False, main=False, progress=False)
    assert run_log.flops_per_token == 4 * n + 6 * L * r * (3 * (D + D) + (D + F)) + attention
    run_log.close()


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
    (["--quick", "--vocab-size", "0"], "expected a positive integer"),
    (["--quick", "--attention", "full,flash"], "unknown attention 'flash'"),
    (["--quick", "--attention", "full", "--attention-impl", "pallas"], "not also --attention-impl"),
    (["--quick", "--shapes", "width=4"], "unknown field 'width'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_input_is_one_error_line(args, message, capsys):
    line = _error_line(capsys, main(args))
    assert message in line, line
    assert message in _error_line(capsys, cli_main(["bench", *args]))


# ---------------------------------------------------------------- selection per backend


def names(specs):
    return [s.name for s in specs]


def test_cpu_default_leaves_out_pallas_and_cudnn_each_with_a_reason():
    run, skipped = select(None, "cpu", None, torch_device="cpu")
    assert names(run) == ["manual_full", "manual_blockwise", "auto_full", "torch_eager", "torch_compile"]
    reasons = {s.name: s.reason for s in skipped}
    assert set(reasons) == {"manual_pallas", "manual_cudnn", "auto_cudnn"}
    assert "interpret mode" in reasons["manual_pallas"] and "--attention" in reasons["manual_pallas"]
    assert "only on a GPU" in reasons["auto_cudnn"] and "only on a GPU" in reasons["manual_cudnn"]


def test_gpu_default_runs_every_contestant_in_bfloat16():
    run, skipped = select(None, "gpu", "bfloat16", torch_device="cuda")
    assert names(run) == JAX_NAMES + ["torch_eager", "torch_compile"] and skipped == []


def test_gpu_cudnn_needs_a_low_precision_compute_dtype():
    run, skipped = select(None, "gpu", None, torch_device="cuda")
    assert "auto_cudnn" not in names(run) and "manual_cudnn" not in names(run)
    assert [s.name for s in skipped] == ["manual_cudnn", "auto_cudnn"]
    assert all("--compute-dtype bfloat16" in s.reason for s in skipped)


def test_explicit_attention_list_runs_pallas_on_cpu_and_marks_the_rest_not_asked():
    run, skipped = select(("full", "pallas"), "cpu", None, torch_device=None,
                          torch_problem="PyTorch is not installed (pip install torch ...)")
    assert names(run) == ["manual_full", "manual_pallas", "auto_full"]
    reasons = {s.name: s.reason for s in skipped}
    assert reasons["manual_blockwise"] == "not asked for (--attention full,pallas)"
    assert reasons["torch_eager"] == reasons["torch_compile"] == "PyTorch is not installed (pip install torch ...)"


def test_cudnn_asked_for_on_cpu_is_skipped_not_run():
    run, skipped = select(("cudnn",), "cpu", "bfloat16", torch_device="cpu", with_torch=False)
    assert names(run) == []
    reasons = {s.name: s.reason for s in skipped}
    assert "only on a GPU" in reasons["auto_cudnn"]
    assert reasons["torch_eager"] == "PyTorch contestants skipped (--no-torch)"


def test_pallas_runs_on_a_tpu_and_is_refused_elsewhere():
    run, _ = select(("pallas",), "tpu", None, torch_device=None, with_torch=False)
    assert names(run) == ["manual_pallas"]
    run, skipped = select(("pallas",), "metal", None, torch_device=None, with_torch=False)
    assert names(run) == [] and "not on metal" in {s.name: s.reason for s in skipped}["manual_pallas"]


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_the_benchmark_chooses_for_the_backend_jax_reports(backend, monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    s = settings_from_args(build_parser().parse_args(["--quick", "--compute-dtype", "bfloat16"]))
    specs, skipped, device = bench.choose(s)
    reasons = {k.name: k.reason for k in skipped}
    if not HAS_TORCH:  # every JAX contestant the backend runs; PyTorch skipped, saying how to get it
        assert reasons["torch_eager"].startswith(NO_TORCH) and device is None
        assert names(specs) == (JAX_NAMES if backend == "gpu" else ["manual_full", "manual_blockwise",
                                                                    "auto_full"])
    elif backend == "cpu":
        assert "manual_pallas" in reasons and "auto_cudnn" in reasons and device == "cpu"
        assert "torch_eager" in names(specs)
    else:  # a CPU build of torch sees no CUDA: PyTorch is skipped, every JAX contestant runs
        assert names(specs) == JAX_NAMES and device is None
        assert "sees no CUDA GPU" in reasons["torch_eager"]


def test_torch_not_installed_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    device, reason = bench_select.torch_device("cpu")
    assert device is None
    assert reason == ("PyTorch is not installed "
                      "(pip install torch --index-url https://download.pytorch.org/whl/cpu)")
    assert bench_select.torch_device("gpu")[1] == "PyTorch is not installed (pip install torch (a CUDA build))"


def test_a_contestant_that_fails_to_compile_is_kept_with_one_line():
    config = get_preset("tiny").replace(compute_dtype="bfloat16")
    params = init_params(jax.random.PRNGKey(0), config)
    heard = []
    [c] = make_contestants([Spec("auto_cudnn", "auto", "cudnn")], config, params,
                           random_batch(config, 2, 8, 0), say=heard.append)
    assert c.run is None and "only on a GPU" in c.error
    assert len(heard) == 1 and heard[0].startswith("auto_cudnn: skipped, it failed to build: ValueError")


@pytest.mark.parametrize("text, message", [
    ("full,flash", "unknown attention 'flash'"),
    ("full,full", "names an attention twice"),
    (",", "expected a comma-separated list"),
])
def test_bad_attention_list(text, message):
    with pytest.raises(ValueError, match=message):
        bench_select.parse_attention(text)


def test_known_gpu_peaks_by_device_kind():
    for kind, bf16 in [("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H200", 989.4e12),
                       ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835.5e12),
                       ("NVIDIA GH200 480GB", 989.4e12), ("NVIDIA A100-SXM4-80GB", 312e12)]:
        device = types.SimpleNamespace(platform="gpu", device_kind=kind)
        peak, source = flops.device_peak(device, "bfloat16")
        assert peak == bf16 and "bfloat16" in source, kind


# ---------------------------------------------------------------- the shape sweep


def test_parse_shapes_and_the_grid_order():
    axes = bench_sweep.parse_shapes("d_model=64,128 seq-len=16,32,64")
    assert axes == {"d_model": (64, 128), "seq_len": (16, 32, 64)}
    points = bench_sweep.grid(axes)
    assert len(points) == 6 and points[0] == {"d_model": 64, "seq_len": 16}
    assert points[1] == {"d_model": 64, "seq_len": 32}  # the last axis varies fastest
    assert bench_sweep.point_label(points[-1]) == "D128 T64"


@pytest.mark.parametrize("text, message", [
    ("d_model", "expected field=v1,v2"),
    ("width=4", "unknown field 'width'"),
    ("d_model=4 d_model=8", "d_model given twice"),
    ("seq_len=8,x", "comma-separated integers"),
    ("n_layers=0", "must be positive"),
    ("  ", "at least one"),
])
def test_bad_shapes(text, message):
    with pytest.raises(ValueError, match=message):
        bench_sweep.parse_shapes(text)


def test_vocab_size_and_no_depth_check():
    """--vocab-size sets the model's vocabulary (the preset's otherwise); --depths none
    leaves the compile-time-vs-depth check out, which the default runs."""
    parse = lambda *argv: settings_from_args(build_parser().parse_args(["--preset", "gpt2", *argv]))  # noqa: E731
    s = parse("--vocab-size", "50304", "--depths", "none")
    assert (s.config.vocab_size, s.config.d_model, s.depths) == (50304, 768, None)
    s = parse()
    assert (s.config.vocab_size, s.depths) == (256, (2, 24))
    assert parse("--depths", "2,12").depths == (2, 12)


def test_point_settings_keep_gpt_ratio_and_room_for_the_sequence():
    base = settings_from_args(build_parser().parse_args(["--quick", "--shapes", "d_model=32"]))
    assert base.depths is None
    s = bench_sweep.point_settings(base, {"d_model": 32, "seq_len": 64})
    assert (s.config.d_model, s.config.d_ff, s.config.max_seq_len, s.seq_len) == (32, 128, 64, 64)
    s = bench_sweep.point_settings(base, {"d_model": 32, "d_ff": 40})
    assert s.config.d_ff == 40 and s.seq_len == base.seq_len
    with pytest.raises(ValueError, match="shape D15: ModelConfig.d_model .15. must be divisible"):
        bench_sweep.point_settings(base, {"d_model": 15})


def test_sweep_writes_table_plot_and_rows(tmp_path):
    code, err = run_main(["--quick", "--shapes", "d_model=8,16", "--attention", "full", "--no-torch",
                          "--out", str(tmp_path)])
    assert code == 0, err
    assert err.count("manual_blockwise, manual_pallas, manual_cudnn, auto_cudnn: skipped: not asked for") == 1
    sweep = json.loads((tmp_path / "report.json").read_text())
    assert sweep["axes"] == {"d_model": [8, 16]} and len(sweep["rows"]) == len(sweep["reports"]) == 2
    for row, d in zip(sweep["rows"], (8, 16)):
        assert row["point"] == {"d_model": d} and row["label"] == f"D{d}"
        assert set(row["tokens_per_s"]) == {"manual_full", "auto_full"}
        assert row["fastest"] in row["tokens_per_s"] and "torch_eager" in row["skipped"]
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# Training-step benchmark over shapes: d_model=8,16")
    assert "| shape | B | T | JAX manual, full | JAX jax.grad, full | fastest |" in md
    assert md.count("| D8 |") + md.count("| D16 |") == 2 and "**" in md
    assert (tmp_path / "bench_sweep.png").stat().st_size > 0
    assert sweep["reports"][0]["grad_fns"] == {}  # no depth check per shape


def test_a_bad_shape_is_one_error_line_before_anything_runs(capsys):
    line = _error_line(capsys, main(["--quick", "--shapes", "d_model=16,15", "--no-torch"]))
    assert "shape D15: ModelConfig.d_model (15) must be divisible by n_heads (2)" in line
