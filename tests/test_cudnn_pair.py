"""cuDNN's pair (jaxformer/kernels/cudnn.py: cudnn_fwd / cudnn_bwd, the hand-derived step's core
for attention_impl "cudnn") launches the kernels JAX's grad launches, with the same settings.

cuDNN runs on a GPU alone, so on this CPU the proof is the program lowered for cuda: the manual
source (the model's ``cudnn`` core as ``manual_grads.attention.cudnn_core_fwd`` and ``cudnn_bwd``)
and ``jax.vjp`` of the model's ``cudnn`` core (``jax.nn.dot_product_attention``'s cuDNN
implementation) hold the same cuDNN custom calls, each with the same backend config (scale, mask
type, window, layout, dropout, the kernels' settings) and the same operand and result types:
causal with grouped key/value heads, a sliding window, packed documents (the mask as cuDNN's
bias) and non-causal. The numbers are cuDNN's on a GPU (experiments/gpu_checks.sh compares
the two sources there). One subprocess with JAX's CUDA plugin and the cuDNN library on its
path (``python -m jaxformer.tools.aot.plugin`` installs both apart, as for tests/test_aot.py).
In this process: the rules' arguments follow the signature of the installed JAX's custom_vjp
(``rule_args``; it changed in JAX 0.12), checked on stand-in signatures."""

import json
import os
import pathlib
import subprocess
import sys
import types

import pytest

from jaxformer.kernels import cudnn
from jaxformer.tools.aot.plugin import cudnn_apart_problem, plugin_dir

pytestmark = pytest.mark.xdist_group("test_cudnn_pair")  # one worker: its module fixture (lowered) runs once

SCRIPT = r"""
import json, re, sys
import jax, jax.numpy as jnp
from jaxformer.tools.aot.targets import cudnn_problem
problem = cudnn_problem()  # loads the cuDNN library of the plugin's folder
if problem:
    print(json.dumps({"problem": problem}))
    raise SystemExit(0)
from jaxformer.model.cores import AttentionSpec, cudnn
from manual_grads.attention import cudnn_core_fwd
from jaxformer.kernels.cudnn import cudnn_bwd

B, H, Hkv, T, Dh = 2, 4, 2, 128, 64
f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
args = (f32(B, H, T, Dh), f32(B, Hkv, T, Dh), f32(B, Hkv, T, Dh), f32(B, H, T, Dh),
        jax.ShapeDtypeStruct((B, T), jnp.int32))

def custom_calls(fn):
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"stablehlo.custom_call @(\S+)\((.*?)\) (\{.*?\}) : (.*?)\n", text, re.S)
    return sorted((name, re.sub(r"%[\w#]+", "%", attrs), types) for name, _, attrs, types in calls)

out = {}
def auto(spec, documents):
    def run(q, k, v, do, s):
        o, vjp = jax.vjp(lambda q, k, v: cudnn(q, k, v, spec, segments=s if documents else None), q, k, v)
        return o, vjp(do.astype(o.dtype))
    return run

def manual(spec, documents):
    def run(q, k, v, do, s):
        o, res = cudnn_core_fwd(q, k, v, spec, segments=s if documents else None)
        return o, cudnn_bwd(res, do)
    return run

bf16 = lambda **kw: AttentionSpec(compute_dtype="bfloat16", **kw)
out = {}
for name, spec, documents in [("causal", bf16(causal=True), False), ("window", bf16(causal=True, window=16), False),
                              ("documents", bf16(causal=True), True), ("non-causal", bf16(causal=False), False)]:
    a, m = custom_calls(auto(spec, documents)), custom_calls(manual(spec, documents))
    out[name] = {"auto": [c[0] for c in a], "manual": [c[0] for c in m], "same": a == m}
# the comparison can fail: the manual source with a window of 17 against JAX's grad with 16
out["window 17 against 16"] = (custom_calls(manual(bf16(causal=True, window=17), False))
                               == custom_calls(auto(bf16(causal=True, window=16), False)))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def lowered():
    if cudnn_apart_problem():
        pytest.skip(cudnn_apart_problem())
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [plugin_dir(), env.get("PYTHONPATH")]))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a process with the plugin keeps out of the suite's cache
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                          cwd=pathlib.Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "problem" not in out, out
    return out


@pytest.mark.parametrize("case", ["causal", "window", "documents", "non-causal"])
def test_the_pair_launches_what_jax_grad_launches(lowered, case):
    calls = lowered[case]
    kind = "ScaleBias" if case == "documents" else ""  # the documents' mask goes in as cuDNN's bias
    assert calls["auto"] == [f"__cudnn$fmha{kind}Softmax", f"__cudnn$fmha{kind}SoftmaxBackward"], calls
    assert calls["same"], calls


def test_the_comparison_sees_a_setting(lowered):
    assert lowered["window 17 against 16"] is False


def test_the_rules_arguments_follow_the_signature_of_this_jax(monkeypatch):
    """JAX's cuDNN custom_vjp changes its signature between versions (0.12 added the score
    modifier's arguments): rule_args orders the named values by the signature it finds, passes
    what a newer JAX adds unused as jax.nn does, and refuses in one line an argument it does not
    know, or static arguments that do not come last (the rules' calls rely on it)."""
    def fun(query, key, value, score_mod_args, scale, score_mod, cudnn_version):
        pass

    fake = types.SimpleNamespace(fun=fun, fwd=None, bwd=None, nondiff_argnums=(4, 5, 6))
    monkeypatch.setattr(cudnn.fa, "_dot_product_attention", fake)
    named = dict(cudnn_version=9, scale=0.5, value="v", key="k", query="q")
    assert cudnn.rule_args(named) == (("q", "k", "v", ()), (0.5, None, 9))

    def newer(query, key, value, block_mask, scale, cudnn_version):
        pass

    fake.fun, fake.nondiff_argnums = newer, (4, 5)
    with pytest.raises(NotImplementedError, match=r"takes block_mask, which the hand-derived source does not pass"):
        cudnn.rule_args(named)
    fake.fun, fake.nondiff_argnums = fun, (1, 5, 6)
    with pytest.raises(NotImplementedError, match="static arguments among its arrays"):
        cudnn.rule_args(named)
