"""`jaxformer doctor --quick` on this CPU: the report names the device and the versions,
what it checked and what it could not (the compiled kernels, cuDNN), states each
measurement against its bound, ends with the verdict, writes the same as JSON and exits
0; with a wrong kernel backward and wrong manual gradients it names those checks failed
and exits 1; a training run that does not learn fails; the checks' programs compile with
their options (CHECK_COMPILE_OPTIONS), and without one the compiler does not know."""

import contextlib
import io
import json
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from xla_flags import legacy_emitter_flag

import manual_grads
from jaxformer.cli.main import main
from jaxformer.kernels.pallas import entry as pallas_entry
from jaxformer.kernels.pallas import norm as norm_kernels
from jaxformer.tools.doctor import checks

pytestmark = pytest.mark.xdist_group("test_doctor")  # one worker: its module fixture (healthy) runs once

VERDICT = "doctor: 9 checks passed, 0 failed, 3 not checked on cpu"


def run_doctor(out):
    """(exit code, stdout, the JSON report) of `jaxformer doctor --quick --out out`."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(io.StringIO()):
        code = main(["doctor", "--quick", "--out", str(out)])
    return code, text.getvalue(), json.loads(out.read_text())


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return run_doctor(tmp_path_factory.mktemp("doctor") / "report.json")


def statuses(report):
    return {c["name"]: c["status"] for c in report["checks"]}


def test_quick_report_names_the_device_the_checks_and_what_it_could_not_check(healthy):
    code, text, report = healthy
    assert code == 0, text
    lines = text.splitlines()
    assert lines[:2] == ["jaxformer doctor on cpu", "  devices   1 x cpu (platform cpu)"]
    assert lines[2].startswith(f"  versions  jax {jax.__version__}, jaxlib ")
    assert all(f"{word} " in lines[2] for word in ("optax", "Python", "jaxformer"))
    assert ("  pallas compiled kernels                  not checked: no GPU/TPU (Pallas compiles for "
            "cuda/rocm/tpu only; cpu runs interpret mode)") in lines
    assert statuses(report) == {
        "pallas compiled kernels": "not checked",
        "pallas float32 (interpret mode)": "passed",
        "pallas bfloat16 (interpret mode)": "passed",
        "cudnn bfloat16": "not checked",
        "norm kernels float32 (interpret mode)": "passed",
        "manual vs jax.grad, float32": "passed",
        "full, manual grads": "passed",
        "blockwise, manual grads": "passed",
        "pallas (interpret mode), manual grads": "passed",
        "cudnn": "not checked",
        "manual_full": "passed",
        "auto_full": "passed",
    }
    assert lines[-2] == report["summary"]["verdict"] == VERDICT
    assert lines[-1].startswith("report: ")
    assert [s["group"] for s in report["sections"]] == ["kernels", "gradients", "training", "bench"]


def test_quick_report_states_the_measurements_and_their_bounds(healthy):
    _, text, report = healthy
    checks = {c["name"]: c for c in report["checks"]}
    f32, bf16 = checks["pallas float32 (interpret mode)"], checks["pallas bfloat16 (interpret mode)"]
    assert set(f32["values"]["rel"]) == {"out", "dq", "dk", "dv"}
    assert max(f32["values"]["rel"].values()) <= f32["values"]["tolerance"] == 1e-5
    assert 1e-4 < max(bf16["values"]["rel"].values()) <= bf16["values"]["tolerance"] == 2e-2  # bfloat16 ran
    grads = checks["manual vs jax.grad, float32"]
    assert grads["values"]["tolerance"] == 1e-4 and len(grads["values"]["rel"]) == 20  # every leaf
    losses = checks["full, manual grads"]["values"]["losses"]
    assert len(losses) == 20 and losses[-1] < 0.9 * losses[0]
    runs = ("full, manual grads", "blockwise, manual grads", "pallas (interpret mode), manual grads")
    firsts = [checks[name]["values"]["losses"][0] for name in runs]
    assert max(firsts) - min(firsts) < 1e-6, firsts  # every run starts from the same params
    assert checks["manual_full"]["values"]["mfu"] > 0 and "  MFU peak: " in text


def test_a_wrong_kernel_backward_and_wrong_manual_gradients_fail(tmp_path, monkeypatch):
    """dQ of the kernel's backward (the rule jax.grad runs through flash_attention) off
    by 10%, every manual gradient leaf off by 0.1%, the norms' backward kernel's dx off by
    0.1%: those four checks fail by name, the rest still run and pass (Adam does not mind
    gradients scaled by 1.001), exit 1."""
    right_bwd, right_vg, right_norm = pallas_entry.flash_core_bwd, manual_grads.value_and_grad, norm_kernels.norm_backward

    def wrong_bwd(res, dout):
        dq, dk, dv = right_bwd(res, dout)
        return dq * 1.1, dk, dv

    def wrong_vg(*args, **kwargs):
        loss, grads = right_vg(*args, **kwargs)
        return loss, jax.tree_util.tree_map(lambda g: g * 1.001, grads)

    def wrong_norm(*args, **kwargs):
        dx, dscale, dbias = right_norm(*args, **kwargs)
        return dx * 1.001, dscale, dbias

    monkeypatch.setattr(pallas_entry, "flash_core_bwd", wrong_bwd)
    monkeypatch.setattr(norm_kernels, "norm_backward", wrong_norm)
    monkeypatch.setattr(manual_grads, "value_and_grad", wrong_vg)
    code, text, report = run_doctor(tmp_path / "broken.json")
    assert code == 1, text
    failed = {name for name, status in statuses(report).items() if status == "failed"}
    assert failed == {"pallas float32 (interpret mode)", "pallas bfloat16 (interpret mode)",
                      "norm kernels float32 (interpret mode)", "manual vs jax.grad, float32"}, text
    assert "passed: worst rel 1.0e-01 (dq) > 1e-05" not in text and "failed: worst rel 1.0e-01 (dq) > 1e-05" in text
    assert "failed: worst leaf rel 1.0e-03" in text and " of 20 leaves over (tok_embed, pos_embed" in text
    assert "failed: worst rel 1.0e-03 (layer dx) > 1e-05" in text or "failed: worst rel 1.0e-03 (rms dx) > 1e-05" in text
    assert report["summary"]["verdict"] == "doctor: 5 checks passed, 4 failed, 3 not checked on cpu"


def test_bad_flags_are_one_error_line(capsys):
    assert main(["doctor", "--seed", "-1"]) == 2
    assert capsys.readouterr().err.startswith("error: argument --seed: expected an integer >= 0")


def test_a_training_run_that_does_not_learn_fails(monkeypatch):
    """Adam climbing the loss (a negated learning rate, as a wrong-signed gradient would):
    the run fails, its losses named."""
    monkeypatch.setattr(checks, "train_impls", lambda platform: [("full", "manual", None)])
    monkeypatch.setattr(checks, "make_optimizer", lambda name, lr: optax.adam(-lr))
    (run, cudnn) = checks.training_checks("cpu", seed=0)
    assert (run.name, run.status) == ("full, manual grads", "failed"), run
    assert re.fullmatch(r"loss \d\.\d{3} -> \d+\.\d{3} in 20 steps; not 10% below the first", run.detail)
    assert run.values["losses"][-1] > run.values["losses"][0]
    assert cudnn.status == "not checked"


class Spy:
    """A lowered program that records the options of each compile before compiling."""

    def __init__(self):
        self.lowered = jax.jit(lambda x: 2 * x).lower(jnp.ones(3, jnp.float32))
        self.options = []

    def compile(self, options=None):
        self.options.append(options)
        return self.lowered.compile(options)


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_the_checks_compile_with_their_options(platform):
    """This XLA takes the options of a CPU and of a GPU on the first try (a GPU's are
    settings a CPU keeps and ignores); an XLA without the CPU's fusion emitters' switch
    (xla_flags.py: jaxlib 0.11) refuses that one, and the second try keeps the other two."""
    spy = Spy()
    assert checks.compile_check(spy, platform)(jnp.ones(3, jnp.float32)).tolist() == [2.0] * 3
    options = checks.CHECK_COMPILE_OPTIONS[platform]
    tries = [options]
    if platform == "cpu" and not legacy_emitter_flag():
        tries.append({k: v for k, v in options.items() if k != "xla_cpu_use_fusion_emitters"})
    assert spy.options == tries


def test_an_option_the_compiler_does_not_know_is_dropped_and_other_errors_are_raised(monkeypatch):
    spy = Spy()
    known = {"xla_backend_optimization_level": 0}
    monkeypatch.setitem(checks.CHECK_COMPILE_OPTIONS, "cpu", {"xla_no_such_option": 1, **known})
    assert checks.compile_check(spy, "cpu")(jnp.ones(3, jnp.float32)).tolist() == [2.0] * 3
    assert spy.options == [{"xla_no_such_option": 1, **known}, known]  # the options it knows kept
    spy = Spy()
    monkeypatch.setitem(checks.CHECK_COMPILE_OPTIONS, "cpu", {"xla_no_such_option": 1})
    assert checks.compile_check(spy, "cpu")(jnp.ones(3, jnp.float32)).tolist() == [2.0] * 3
    assert spy.options == [{"xla_no_such_option": 1}, None]
    monkeypatch.setitem(checks.CHECK_COMPILE_OPTIONS, "cpu", {"xla_backend_optimization_level": "fast"})
    with pytest.raises(Exception, match="not a valid int32"):  # the options reach XLA
        checks.compile_check(Spy(), "cpu")
