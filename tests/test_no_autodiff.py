"""manual_grads/ derives every gradient by hand: no module but check.py may call
JAX's autodiff (jax.grad, jax.vjp, jax.jvp, jax.value_and_grad, jax.linear_transpose).

Two nets: the sources of manual_grads/ are scanned for those names, and
manual_grads.value_and_grad is traced for every model option with JAX's autodiff
entry points patched to raise, so that no forward helper it calls (in jaxformer/model/
too) can hide one; the traced program is then searched for the primitives that a
checkpoint or a custom rule leaves behind."""

import ast
import io
import pathlib
import re
import tokenize

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import pytest
from helpers import equations
from jax._src.interpreters import ad as jax_ad

import manual_grads
from jaxformer.model.config import ModelConfig
from jaxformer.model.params import init_params

FORBIDDEN = {"grad", "vjp", "jvp", "value_and_grad", "linear_transpose"}
ALLOWED_FILES = {"check.py"}
SOURCE_DIR = pathlib.Path(manual_grads.__file__).parent
SOURCES = sorted(p for p in SOURCE_DIR.rglob("*.py") if p.name not in ALLOWED_FILES)


def code_only(source: str) -> str:
    """``source`` without its comments and string literals (docstrings may name
    jax.grad: the manual backward is compared with it)."""
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    kept = [t for t in tokens if t.type not in (tokenize.COMMENT, tokenize.STRING)]
    return tokenize.untokenize(kept)


def autodiff_uses(source: str) -> list[str]:
    """Every use of a forbidden autodiff function in ``source``: attribute access
    (jax.grad, jax.api.vjp, ...), imports (from jax import grad), getattr(jax, "grad"),
    and, as a net for anything else, the words after "jax" in the code."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN:
            found.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jax":
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name in FORBIDDEN]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and any(isinstance(a, ast.Constant) and a.value in FORBIDDEN for a in node.args)):
            found.append(f"line {node.lineno}: getattr")
    pattern = r"\bjax\b[\w.]*\.\s*(" + "|".join(sorted(FORBIDDEN)) + r")\b"
    for lineno, line in enumerate(code_only(source).splitlines(), 1):
        found += [f"line {lineno}: {m.group(0)}" for m in re.finditer(pattern, line)]
    return found


def test_sources_found():
    names = {p.name for p in SOURCES}
    assert {"linear.py", "attention.py", "model.py", "custom_vjp.py"} <= names


@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES])
def test_no_autodiff_in_manual_grads(path):
    uses = autodiff_uses(path.read_text())
    assert not uses, f"{path.name} uses JAX autodiff: {uses}"


@pytest.mark.parametrize("snippet", [
    "import jax\ny = jax.grad(f)(x)",
    "import jax\ny, f_vjp = jax.vjp(f, x)",
    "from jax import value_and_grad\n",
    "from jax import linear_transpose as lt\n",
    "import jax as J\nJ.jvp(f, (x,), (t,))",
    "import jax\nf = getattr(jax, 'grad')",
])
def test_scanner_catches_autodiff(snippet):
    assert autodiff_uses(snippet)


def test_scanner_allows_custom_vjp_and_docs():
    assert not autodiff_uses('"""Equals jax.grad."""\nimport jax\nf = jax.custom_vjp(g)  # not jax.vjp\n')


# ------------------------------------------------------------ tracing with autodiff patched out

# (module, attribute): JAX's public autodiff entry points, and a custom rule's makers
PUBLIC_ENTRY_POINTS = [(jax, name) for name in (
    "grad", "value_and_grad", "vjp", "jvp", "linearize", "linear_transpose", "jacfwd", "jacrev",
    "hessian", "checkpoint", "remat", "custom_vjp", "custom_jvp")]
# jax.ad_checkpoint.checkpoint: removed in JAX 0.10 (jax.checkpoint is the one name left)
PUBLIC_ENTRY_POINTS += [(jax.ad_checkpoint, n) for n in ("checkpoint", "remat") if hasattr(jax.ad_checkpoint, n)]
# The net below them: the functions of jax._src.interpreters.ad through which every jvp, vjp
# and transpose runs, so that ``from jax import vjp`` bound before the patch is caught too.
# (Internal to JAX: if an upgrade renames them, the patch fails loudly rather than weakening.)
INTERNAL_ENTRY_POINTS = [(jax_ad, name) for name in ("jvp", "linearize", "backward_pass")]
# Primitives a jax.checkpoint, custom_vjp or custom_jvp leaves in a traced program (a rule
# built at import time escapes the patch, not the jaxpr). jax.nn's custom_jvp functions in
# the forward are allowed: the manual path never differentiates them.
FORBIDDEN_PRIMITIVES = {"checkpoint", "remat", "remat2", "custom_vjp_call", "custom_vjp_call_jaxpr",
                        "custom_lin"}


class AutodiffCalled(AssertionError):
    pass


@pytest.fixture
def no_autodiff(monkeypatch):
    """JAX's autodiff entry points raise AutodiffCalled while the test runs; JAX's trace
    caches are emptied first, so that nothing traced before comes back unchecked."""
    for module, name in PUBLIC_ENTRY_POINTS + INTERNAL_ENTRY_POINTS:
        def refuse(*args, _name=f"{module.__name__}.{name}", **kwargs):
            raise AutodiffCalled(f"{_name} called while tracing the manual gradient")
        monkeypatch.setattr(module, name, refuse)
    jax.clear_caches()
    yield
    jax.clear_caches()


def primitives(jaxpr) -> set[str]:
    """Names of every primitive in ``jaxpr`` and in the jaxprs nested in it."""
    return {eqn.primitive.name for eqn in equations(jaxpr)}


TINY = ModelConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=2, d_ff=12, max_seq_len=8)
OPTIONS = {  # together: every value of every option the manual path branches on
    "pre-full-learned": {},
    "post-sinusoidal-relu": dict(norm="post", positions="sinusoidal", activation="relu"),
    "blockwise-masked-gelu_tanh": dict(attention_impl="blockwise", attention_block=3,
                                       activation="gelu_tanh", mask=True),
    "chunked-loss-tanh": dict(loss_chunk=5, activation="tanh", causal=False),
    "remat-block-post-blockwise": dict(remat="block", norm="post", attention_impl="blockwise",
                                       attention_block=4, mask=True),
    "bfloat16-lean": dict(compute_dtype="bfloat16", attention_impl="blockwise", attention_block=4,
                          loss_chunk=3, remat="block", positions="sinusoidal", mask=True),
    "bfloat16-plain": dict(compute_dtype="bfloat16", norm="post"),
    "gpt2-options-dropout": dict(tie_embeddings=True, bias=False, head_bias=False, dropout=0.1,
                                 embed_scale=True, mask=True),
    "deep-scanned-head-bias-free": dict(n_layers=5, head_bias=False, dropout=0.1,
                                        positions="sinusoidal"),
    "pallas": dict(attention_impl="pallas", pallas_block_q=4, pallas_block_k=4, mask=True),
    "modern-full": dict(norm_type="rms", positions="rope", mlp="gated", activation="silu",
                        n_kv_heads=1, qk_norm=True, bias=False, mask=True),
    "modern-blockwise-remat-post": dict(norm_type="rms", norm_scale=False, positions="rope", mlp="gated",
                                        activation="relu2", n_kv_heads=1, attention_impl="blockwise",
                                        attention_block=3, remat="block", norm="post", dropout=0.1),
    "modern-pallas-bfloat16": dict(attention_impl="pallas", pallas_block_q=4, pallas_block_k=4,
                                   n_kv_heads=1, positions="rope", qk_norm=True, norm_type="rms",
                                   compute_dtype="bfloat16"),
}


def traced_manual_gradient(options):
    """The jaxpr of manual_grads.value_and_grad at TINY with ``options``, traced from the
    shapes of params and batch (nothing is compiled or run)."""
    options = dict(options)
    masked = options.pop("mask", False)
    config = TINY.replace(**options)
    dtype = jnp.float32 if config.compute_dtype else jnp.float64
    params = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config, dtype))
    tokens = jax.ShapeDtypeStruct((2, 7), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    if masked:
        batch["mask"] = jax.ShapeDtypeStruct((2, 7), jnp.bool_)
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0)) if config.dropout else None
    return jax.make_jaxpr(lambda p, b, k: manual_grads.value_and_grad(p, b, config, key=k))(
        params, batch, key)


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS)
def test_manual_gradient_traces_without_autodiff(options, no_autodiff):
    found = primitives(traced_manual_gradient(options).jaxpr) & FORBIDDEN_PRIMITIVES
    assert not found, f"manual_grads.value_and_grad traces {sorted(found)}"


def sin_gradient_by_vjp(x):
    """A forward helper hiding autodiff behind ``jax.vjp`` attribute lookup."""
    return jax.vjp(jnp.sin, x)[1](jnp.ones_like(x))[0]


def test_patch_catches_a_helper_calling_jax_vjp(no_autodiff):
    with pytest.raises(AutodiffCalled, match="jax.vjp"):
        jax.make_jaxpr(sin_gradient_by_vjp)(jnp.ones(3))


def test_patch_catches_autodiff_bound_before_it(no_autodiff):
    """A name taken before the patch (``from jax import grad`` at import time) escapes the
    public net; the internal one below catches it."""
    with pytest.raises(AutodiffCalled, match="jax._src.interpreters.ad"):
        jax.make_jaxpr(GRAD_BOUND_AT_IMPORT(jnp.sin))(1.0)


GRAD_BOUND_AT_IMPORT = jax.grad


def test_patch_is_undone_after_the_test():
    assert float(jax.grad(jnp.sin)(0.0)) == 1.0


@pytest.mark.parametrize("make", [jax.checkpoint, jax.custom_vjp], ids=["checkpoint", "custom_vjp"])
def test_primitive_scan_catches_rules_built_at_import_time(make):
    """A checkpoint or custom_vjp built before the patch leaves its primitive in the jaxpr."""
    f = make(jnp.sin)
    if make is jax.custom_vjp:
        f.defvjp(lambda x: (jnp.sin(x), x), lambda x, dy: (dy * jnp.cos(x),))
    body = lambda xs: jax.lax.scan(lambda c, x: (c + f(x), None), 0.0, xs)[0]  # noqa: E731
    assert primitives(jax.make_jaxpr(body)(jnp.ones(3)).jaxpr) & FORBIDDEN_PRIMITIVES
