"""The benchmark of a mixture of experts: FLOPs counted with the k active experts' weights
(the router's, the chosen experts', the shared expert's), checked by hand and against the
params init_params makes; ``jaxformer bench --preset tiny-moe`` runs manual and jax.grad, with
the active-parameter MFU, XLA's memory and PyTorch skipped with its reason (never its timings)."""

import contextlib
import io
import json

import jax
import pytest

from jaxformer.cli.bench import main
from jaxformer.model.config import get_preset
from jaxformer.model.params import init_params
from jaxformer.observe import flops
from jaxformer.tools.bench.run import MOE_TORCH

TINY_MOE = get_preset("tiny-moe")  # L2 D16 H4 Hkv2 (Dh 4), E4 k2 Fe12, V256, gated experts


@pytest.mark.parametrize("changes", [dict(), dict(shared_expert_d_ff=8), dict(experts_per_token=1, n_experts=8),
                                     dict(shared_expert_d_ff=8, shared_expert_gate=False, n_kv_heads=0)])
def test_active_params_are_the_matmul_leaves_with_k_of_e_experts(changes):
    """The count from init_params' leaves: every weight matrix (no norms, no embedding
    gather), each expert leaf (E, ...) counted for k of its E experts."""
    config = TINY_MOE.replace(**changes)
    shapes = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config))
    E, k, total = config.n_experts, config.experts_per_token, 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        name = jax.tree_util.keystr(path)
        if leaf.ndim < 2 + ("blocks" in name) or "tok_embed" in name:
            continue  # norms' scales, biases; the embedding is a gather
        expert = "ffn" in name and "shared" not in name and "router" not in name
        total += leaf.size * k // E if expert else leaf.size
    assert flops.matmul_params(config) == total


@pytest.fixture(scope="module")
def moe_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_moe")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--quick", "--preset", "tiny-moe", "--attention", "full", "--depths", "2,2", "--out", str(out)])
    assert code == 0, err.getvalue()
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text(), err.getvalue()


def test_tiny_moe_bench_reports_manual_and_jax_grad_with_active_mfu(moe_report):
    report, markdown, err = moe_report
    per_token = flops.flops_per_token(TINY_MOE, 8)
    assert report["flops"]["per_token"] == per_token
    for name in ("manual_full", "auto_full"):
        r = report["contestants"][name]
        assert r["status"] == "ran"
        assert r["model_flops_per_s"] == pytest.approx(r["tokens_per_s"]["median"] * per_token)
        assert r["memory"]["temp_bytes"] > 0
        if report["peak"]["flops_per_s"]:
            assert r["mfu"] == pytest.approx(r["model_flops_per_s"] / report["peak"]["flops_per_s"])
    assert set(report["grad_fns"]) == {"manual", "auto"} and report["grad_fns"]["manual"]["memory"]
    for name in ("torch_eager", "torch_compile"):
        assert report["contestants"][name] == {"status": "skipped", "reason": MOE_TORCH, "error": None}
    assert f"skipped: {MOE_TORCH}" in err
    assert "L2 D16 H4 F24 E4 k2 Fe12 B2 T8" in markdown
    assert f"the active parameters ({flops.matmul_params(TINY_MOE):,} of the " in markdown
