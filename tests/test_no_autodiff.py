"""manual_grads/ derives every gradient by hand: no module but check.py may call
JAX's autodiff (jax.grad, jax.vjp, jax.jvp, jax.value_and_grad, jax.linear_transpose)."""

import ast
import io
import pathlib
import re
import tokenize

import pytest

import manual_grads

FORBIDDEN = {"grad", "vjp", "jvp", "value_and_grad", "linear_transpose"}
ALLOWED_FILES = {"check.py"}
SOURCE_DIR = pathlib.Path(manual_grads.__file__).parent
SOURCES = sorted(p for p in SOURCE_DIR.glob("*.py") if p.name not in ALLOWED_FILES)


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
