"""The main job, jaxformer.tools.compare.grads and its command line jaxformer.cli.compare_grads
(experiments/compare_grads.py): on the tiny preset in float64, every leaf of the real
manual gradient passes, the three reports are written and parse, and a deliberately
perturbed manual gradient makes the job fail naming the leaf, in run_comparison and in
main's exit code."""

import contextlib
import copy
import io
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxformer import init_params
from jaxformer.cli import compare_grads
from jaxformer.cli.args import UsageError
from jaxformer.data import CharTokenizer, load_corpus
from jaxformer.model.config import PRESETS
from jaxformer.tools.compare import grads as compare
from jaxformer.tools.compare import fd as compare_fd
from jaxformer.tools.compare import report as compare_report
from jaxformer.tools.compare import leaves

pytestmark = pytest.mark.xdist_group("test_compare")  # one worker: its module fixture (good_run) runs once

ROOT = Path(__file__).resolve().parents[1]
PERTURBED = ("blocks", "ffn", "w_in")  # the leaf the broken gradient source gets wrong
PERTURBED_PATH = "blocks.ffn.w_in"


def real_manual_fn():
    try:
        return compare.manual_value_and_grad()
    except (ImportError, AttributeError) as err:
        pytest.skip(f"manual_grads.value_and_grad is not available: {err}")


def perturbed(manual_fn, scale):
    """A gradient source equal to ``manual_fn`` except one leaf, off by a relative ``scale``."""
    def fn(params, batch, config):
        loss, grads = manual_fn(params, batch, config)
        a, b, c = PERTURBED
        grads = {**grads, a: {**grads[a], b: {**grads[a][b], c: grads[a][b][c] * (1 + scale)}}}
        return loss, grads
    return fn


@pytest.fixture(scope="module")
def broken_fn():
    """One function object for both tests below, so jit compiles it once."""
    return perturbed(real_manual_fn(), scale=1e-3)


def run_main(argv, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = compare_grads.main(argv, **kwargs)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def good_run(tmp_path_factory):
    """One run of main on tiny, float64, with finite differences."""
    real_manual_fn()
    out = tmp_path_factory.mktemp("compare_grads")
    rc, stdout, stderr = run_main(["--preset", "tiny", "--dtype", "float64", "--fd",
                                   "--repeats", "2", "--out", str(out)])
    return rc, stdout, stderr, out


# ---------------------------------------------------------------------------- real gradients


def test_every_leaf_passes_with_the_real_manual_gradients(good_run):
    rc, stdout, stderr, out = good_run
    assert rc == 0, stdout + stderr
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is True
    (p,) = report["presets"]
    assert p["preset"] == "tiny" and p["dtype"] == "float64" and p["tolerance"] == 1e-10
    assert p["passed"] and p["failures"] == []
    assert p["loss"]["passed"] and p["loss"]["rel"] <= 1e-12
    bad = [(x["path"], x["rel"]) for x in p["leaves"] if not x["passed"] or not x["rel"] <= 1e-10]
    assert bad == []
    # cosine says nothing where the true gradient is zero (the attention key bias)
    big = max(x["ref_norm"] for x in p["leaves"]) * 1e-6
    assert all(x["cosine"] > 1 - 1e-12 for x in p["leaves"] if x["ref_norm"] > big)
    assert p["fd"]["passed"], p["fd"]
    assert all(x["rel"] <= compare_fd.FD_TOLERANCE for x in p["fd"]["leaves"] + p["fd"]["whole_tree"])


def test_json_report_structure(good_run):
    _, _, _, out = good_run
    report = json.loads((out / "report.json").read_text())
    assert {"passed", "created", "options", "environment", "presets"} <= set(report)
    assert report["options"]["preset"] == ["tiny"] and report["options"]["fd"] is True
    (p,) = report["presets"]
    assert {"preset", "config", "n_params", "dtype", "tolerance", "batch_size", "seq_len", "loss",
            "leaves", "blocks", "timings", "fd", "failures", "passed"} <= set(p)
    # seq_len is cut to the preset's max_seq_len (default 32 > tiny's 16)
    assert (p["batch_size"], p["seq_len"]) == (4, PRESETS["tiny"].max_seq_len)
    assert [x["path"] for x in p["leaves"]] == [  # model order, not jax's sorted keys
        "tok_embed", "pos_embed", "blocks.ln1.scale", "blocks.ln1.bias",
        "blocks.attn.wq", "blocks.attn.bq", "blocks.attn.wk", "blocks.attn.bk",
        "blocks.attn.wv", "blocks.attn.bv", "blocks.attn.wo", "blocks.attn.bo",
        "blocks.ln2.scale", "blocks.ln2.bias", "blocks.ffn.w_in", "blocks.ffn.b_in",
        "blocks.ffn.w_out", "blocks.ffn.b_out", "ln_f.scale", "ln_f.bias", "head.w", "head.b"]
    for x in p["leaves"]:
        assert {"path", "shape", "max_abs", "rel", "cosine", "passed"} <= set(x)
    assert [b["block"] for b in p["blocks"]] == [
        "tok_embed", "pos_embed", "blocks.ln1", "blocks.attn", "blocks.ln2", "blocks.ffn",
        "ln_f", "head"]
    assert sum(b["n_leaves"] for b in p["blocks"]) == len(p["leaves"])
    for source in ("manual", "auto"):
        t = p["timings"][source]
        assert t["compile_s"] > 0 and t["step_s"] > 0 and len(t["steps_s"]) == 2
    assert p["timings"]["ratio_step"] == pytest.approx(
        p["timings"]["manual"]["step_s"] / p["timings"]["auto"]["step_s"])
    assert len(p["fd"]["leaves"]) == len(p["leaves"]) and len(p["fd"]["whole_tree"]) == 3


def test_markdown_and_png_reports(good_run):
    _, _, _, out = good_run
    md = (out / "report.md").read_text()
    assert "Overall: **PASS**" in md
    assert "| leaf | shape | max abs err | rel err | cosine | result | fd rel err |" in md
    for leaf in ("tok_embed", "blocks.attn.wq", "head.w"):
        assert f"| `{leaf}` |" in md
    assert "| block | leaves | worst rel err | worst leaf | result |" in md
    assert "rel_errors.png" in md
    png = (out / "rel_errors.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_terminal_output(good_run):
    _, stdout, _, out = good_run
    assert "tiny: PASS" in stdout and "overall: PASS" in stdout
    assert "\033[" not in stdout  # no color codes when not writing to a terminal
    table = [line for line in stdout.splitlines() if line.startswith(("tok_embed ", "head.w "))]
    assert len(table) == 3  # two leaf rows, one block row (tok_embed)
    assert "manual / autodiff" in stdout
    assert str(out / "report.json") in stdout


def test_reports_with_a_nan_leaf_stay_strict_json(good_run, tmp_path):
    _, _, _, out = good_run
    report = json.loads((out / "report.json").read_text())
    broken = copy.deepcopy(report)
    leaf = broken["presets"][0]["leaves"][0]
    leaf["rel"], leaf["passed"] = math.nan, False
    broken["presets"][0]["passed"] = broken["passed"] = False
    paths = compare_report.write_reports(broken, tmp_path)
    text = paths["json"].read_text()
    assert "NaN" not in text and json.loads(text)["presets"][0]["leaves"][0]["rel"] == "nan"
    assert "Overall: **FAIL**" in paths["markdown"].read_text()
    assert paths["png"].exists()


# ---------------------------------------------------------------------------- a broken gradient


def test_run_comparison_fails_on_a_perturbed_leaf(broken_fn):
    config = PRESETS["tiny"]
    params = jax.jit(init_params, static_argnums=(1, 2))(jax.random.PRNGKey(0), config, jnp.float64)
    batch = compare.make_batch(config, 4, 16, seed=0)
    r = compare.run_comparison(config, params, batch, name="tiny", repeats=1, manual_fn=broken_fn)
    assert not r.passed
    assert len(r.failures) == 1 and r.failures[0].startswith(PERTURBED_PATH), r.failures
    bad = [x for x in r.leaves if not x["passed"]]
    assert [x["path"] for x in bad] == [PERTURBED_PATH]
    assert bad[0]["rel"] == pytest.approx(1e-3, rel=1e-6)
    assert r.loss["passed"]
    (block,) = [b for b in r.blocks if not b["passed"]]
    assert block["block"] == "blocks.ffn" and block["worst_leaf"] == PERTURBED_PATH


def test_main_exits_nonzero_and_names_the_leaf(broken_fn, tmp_path):
    rc, stdout, stderr = run_main(
        ["--preset", "tiny", "--dtype", "float64", "--repeats", "1", "--out", str(tmp_path)],
        manual_fn=broken_fn)
    assert rc != 0
    assert f"FAIL tiny: {PERTURBED_PATH}" in stderr
    assert "tiny: FAIL" in stdout and "overall: FAIL" in stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] is False
    (p,) = report["presets"]
    assert p["dtype"] == "float64" and p["tolerance"] == 1e-10
    assert [x["path"] for x in p["leaves"] if not x["passed"]] == [PERTURBED_PATH]
    assert "**FAIL**" in (tmp_path / "report.md").read_text()


# ---------------------------------------------------------------------------- dropout, tokenizers


def test_dropout_is_compared_with_one_key_for_both_sources():
    """With dropout both sources get the same key: they agree (and finite differences of
    the dropped-out loss agree with the manual gradient); the loss is not the plain one;
    a manual source that ignores the key fails."""
    config = PRESETS["tiny"].replace(dropout=0.2)
    params = jax.jit(init_params, static_argnums=(1, 2))(jax.random.PRNGKey(0), config, jnp.float64)
    batch = compare.make_batch(config, 4, 16, seed=0)
    r = compare.run_comparison(config, params, batch, name="tiny", repeats=1, fd=True)
    assert r.passed, r.failures
    plain = compare.run_comparison(config.replace(dropout=0.0), params, batch, repeats=1)
    assert plain.passed and abs(r.loss["manual"] - plain.loss["manual"]) > 1e-4

    manual = real_manual_fn()

    def keyless(params, batch, config, key=None):
        return manual(params, batch, config)
    r = compare.run_comparison(config, params, batch, repeats=1, manual_fn=keyless)
    assert not r.passed and r.failures[0].startswith("loss: manual"), r.failures


def test_the_batch_tokenizer_fits_the_vocabulary(tmp_path):
    tiny = PRESETS["tiny"]
    assert compare.batch_tokenizer(tiny).kind == "byte"
    assert compare.batch_tokenizer(tiny.replace(vocab_size=300)).kind == "byte"  # ids < 256
    with pytest.raises(ValueError, match="the byte tokenizer has 256 tokens, more than the "
                                         "config's vocab_size 97"):
        compare.batch_tokenizer(tiny.replace(vocab_size=97))
    chars = CharTokenizer.from_text(load_corpus("default"))  # a model folder's own tokenizer
    (tmp_path / "tokenizer.json").write_text(json.dumps(chars.to_dict()))
    config = tiny.replace(vocab_size=chars.vocab_size)
    assert compare.batch_tokenizer(config, tmp_path) == chars
    batch = compare.make_batch(config, 2, 8, 0, compare.batch_tokenizer(config, tmp_path))
    assert int(batch["inputs"].max()) < chars.vocab_size
    with pytest.raises(ValueError, match=f"tokenizer.json has {chars.vocab_size} tokens, more "
                                         "than the config's vocab_size 50"):
        compare.batch_tokenizer(tiny.replace(vocab_size=50), tmp_path)


# ---------------------------------------------------------------------------- command line


def test_parse_args_defaults_and_choices():
    args = compare_grads.parse_args([])
    assert args.preset == list(compare.DEFAULT_PRESETS) == ["loopos", "sunfish", "cllm"]
    assert (args.dtype, args.batch_size, args.seq_len, args.fd) == ("float32", 4, 32, False)
    assert args.out == "runs/compare_grads"
    again = compare_grads.parse_args(["--preset", "tiny", "cllm", "--preset", "tiny"])
    assert again.preset == ["tiny", "cllm"]
    for bad, words in ((["--preset", "nope"], "invalid choice: 'nope'"),
                       (["--dtype", "float16"], "invalid choice: 'float16'"),
                       (["--repeats", "0"], "--repeats: expected a positive integer")):
        with pytest.raises(UsageError, match=words):
            compare_grads.parse_args(bad)
        rc, stdout, stderr = run_main(bad)  # one error line, exit code 2
        assert rc == 2 and stdout == "" and stderr.splitlines() == [stderr.strip()], stderr
        assert stderr.startswith("error: ") and words in stderr, stderr


def test_leaf_names_and_blocks():
    assert leaves.dotted("['blocks']['attn']['wq']") == "blocks.attn.wq"
    assert leaves.dotted("['tok_embed']") == "tok_embed"
    assert leaves.block_of("blocks.attn.wq") == "blocks.attn"
    assert leaves.block_of("head.w") == "head" and leaves.block_of("tok_embed") == "tok_embed"


def test_script_help():
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "compare_grads.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    for flag in ("--preset", "--dtype", "--fd", "--batch-size", "--seq-len", "--seed",
                 "--repeats", "--out", "--compute-dtype", "--attention-impl", "--loss-chunk",
                 "--d-model"):
        assert flag in res.stdout


def test_the_modern_block_passes_compare_grads_with_finite_differences(tmp_path):
    """`jaxformer compare-grads --preset llama-tiny --dtype float64 --fd`: every leaf of the
    modern block (rotary, RMS norm, SwiGLU, grouped-query attention, QK-norm) passes, against
    jax.grad and against finite differences; and the smollm preset shrunk by flags too."""
    rc, stdout, _ = run_main(["--preset", "llama-tiny", "--dtype", "float64", "--fd", "--repeats", "1",
                              "--out", str(tmp_path / "tiny")])
    assert rc == 0, stdout
    for leaf in ("blocks.attn.q_norm.scale", "blocks.attn.wk", "blocks.ffn.w_gate", "blocks.ffn.w_up"):
        assert leaf in stdout
    assert "finite differences" in stdout and "llama-tiny: PASS" in stdout
    rc, stdout, _ = run_main(["--preset", "smollm", "--dtype", "float64", "--n-layers", "1",
                              "--d-model", "48", "--n-heads", "6", "--n-kv-heads", "2", "--d-ff", "64",
                              "--batch-size", "2", "--seq-len", "9", "--repeats", "1",
                              "--out", str(tmp_path / "smollm")])
    assert rc == 0 and "smollm: PASS" in stdout, stdout
