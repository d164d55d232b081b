"""Helpers shared by the test files: one manual-layer-vs-jax.vjp harness, the
bfloat16-vs-autodiff judgement, the equations of a jaxpr, and test inputs."""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import random
import subprocess
import sys
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxformer
from jaxformer import loss_fn
from jaxformer.model.config import PRESETS
from jaxformer.tools.compare import grads as compare
from jaxformer.training.settings import settings_for
from manual_grads import check, custom_vjp, value_and_grad
from xla_flags import suite_flags

# ---------------------------------------------------------------- a manual layer against jax.vjp


def _same(cotangents):
    return cotangents


class Layer(NamedTuple):
    """A manual pair and the model function it mirrors, each called as
    ``f(*primals, *consts, *static)``: primals are differentiated, consts are arrays that
    are not (token ids, targets, masks), static are Python values (jit-static)."""
    fwd: Callable  # -> (y, res)
    bwd: Callable  # (res, dy) -> cotangents
    forward: Callable  # the model's function -> y
    cotangents: Callable = _same  # bwd's output -> the primals' cotangents, as jax.vjp gives them


def _manual(layer, primals, consts, dy, static):
    y, res = layer.fwd(*primals, *consts, *static)
    return y, layer.bwd(res, dy)


def _reference(layer, primals, consts, dy, static):
    y, vjp = jax.vjp(lambda *p: layer.forward(*p, *consts, *static), *primals)
    return y, vjp(dy)


def _both(layer, primals, consts, dy, static):
    return _manual(layer, primals, consts, dy, static), _reference(layer, primals, consts, dy, static)


_BOTH = jax.jit(_both, static_argnums=(0, 4))  # one compile per case for manual and reference
_REFERENCE = jax.jit(_reference, static_argnums=(0, 4))


def layer_and_vjp(layer: Layer, primals, dy, consts=(), static=(), jit: bool = True):
    """((y, bwd's output), (y_ref, jax.vjp's cotangents)): the manual pair run jitted with the
    reference, or eagerly (``jit=False``) beside the jitted reference."""
    args = (layer, tuple(primals), tuple(consts), dy, tuple(static))
    return _BOTH(*args) if jit else (_manual(*args), _REFERENCE(*args))


def vjp_of_forward(layer: Layer, primals, dy, consts=(), static=()):
    """(y_ref, jax.vjp's cotangents) of the model function alone, jitted."""
    return _REFERENCE(layer, tuple(primals), tuple(consts), dy, tuple(static))


def assert_layer_matches_vjp(layer: Layer, primals, dy, consts=(), static=(), *, jit: bool = True,
                             y_rtol: float = 1e-13, y_atol: float = 1e-13, rtol: float = 1e-10):
    """The manual pair's output equals the model function's within (y_rtol, y_atol) and its
    cotangents equal jax.vjp's leaf by leaf within ``rtol`` (a missing or extra leaf fails).
    Returns ((y, bwd's output), (y_ref, jax.vjp's cotangents))."""
    (y, out), (y_ref, grads_ref) = layer_and_vjp(layer, primals, dy, consts, static, jit)
    np.testing.assert_allclose(y, y_ref, rtol=y_rtol, atol=y_atol)
    check.assert_trees_close(grads_ref, layer.cotangents(out), rtol=rtol)
    return (y, out), (y_ref, grads_ref)


# ---------------------------------------------------------------- the model's functions, jitted

# config static: one compile per config and shape, where run eagerly each operation compiles
# on its own
FORWARD = jax.jit(jaxformer.forward, static_argnums=2)
LOSS = jax.jit(loss_fn, static_argnums=2)
auto_vg = jax.jit(jax.value_and_grad(loss_fn), static_argnums=2)
manual_vg = jax.jit(value_and_grad, static_argnums=2)


# ---------------------------------------------------------------- bfloat16 against autodiff


def leaf_rels(ref, got):
    return {c.path: c.rel for c in check.compare_trees(ref, got)}


def assert_bfloat16_within_autodiff(params, batch, config, key=None):
    """Under compute_dtype bfloat16, each leaf's manual gradient is as close to the
    float32 reference (the same params without a compute dtype) as autodiff's.
    ``key``: dropout's key, the same for all three (None: no dropout)."""
    mixed = config.replace(compute_dtype="bfloat16")
    loss_ref, ref = auto_vg(params, batch, config, key=key)
    loss_a, grads_a = auto_vg(params, batch, mixed, key=key)
    loss_m, grads_m = manual_vg(params, batch, mixed, key=key)
    assert {x.dtype for x in jax.tree_util.tree_leaves((grads_a, grads_m))} == {jnp.dtype("float32")}
    err_a, err_m = leaf_rels(ref, grads_a), leaf_rels(ref, grads_m)
    for path in err_a:
        assert compare.mixed_precision_passed(err_m[path], err_a[path]), (path, err_m[path], err_a[path])
    # bfloat16 really ran: the gradients moved by bfloat16 round-off (2^-9), not float32's
    assert 1e-4 < max(err_a.values()) < 0.1 and 1e-4 < max(err_m.values()) < 0.1
    assert float(loss_m) == pytest.approx(float(loss_a), rel=1e-6)
    assert float(loss_a) == pytest.approx(float(loss_ref), rel=1e-2)


# ---------------------------------------------------------------- jaxprs


def equations(jaxpr):
    """Every equation of a jaxpr, and of the jaxprs nested in its equations (scan and
    while bodies, cond branches, jit calls, custom rules)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                if hasattr(sub, "eqns"):
                    yield from equations(getattr(sub, "jaxpr", sub))


def dot_generals(jaxpr):
    """Every dot_general equation of a jaxpr, inside scans and jits too."""
    return (eqn for eqn in equations(jaxpr) if eqn.primitive.name == "dot_general")


# ---------------------------------------------------------------- inputs


def attention_params(seed, B, T, D):
    """Attention params {wq, bq, ..., wo, bo} (D, D) / (D,), an input x and a cotangent dy (B, T, D)."""
    rng = np.random.default_rng(seed)
    p = {}
    for name in "qkvo":
        p["w" + name] = rng.standard_normal((D, D)) / np.sqrt(D)
        p["b" + name] = 0.5 * rng.standard_normal(D)
    return p, rng.standard_normal((B, T, D)), rng.standard_normal((B, T, D))


def masks(seed, B, T):
    """Loss masks by name: none, mostly zero (one position kept at least), bool, int, all zero."""
    rng = np.random.default_rng(seed)
    mostly_zero = (rng.random((B, T)) < 0.2).astype(np.float64)
    mostly_zero.flat[0] = 1.0
    return {"none": None, "mostly_zero": mostly_zero, "bool": rng.random((B, T)) < 0.5,
            "int": (rng.random((B, T)) < 0.5).astype(np.int32), "zeros": np.zeros((B, T))}


def make_params(config, dtype, seed=0):
    """Random params with init_params' tree, shapes and dtype: N(0, 0.05^2) everywhere,
    plus 1 for layer-norm scales, so biases are nonzero and scales not 1 (init_params
    starts them at 0 and 1, where a wrong bias or scale gradient could hide)."""
    shapes = jax.eval_shape(lambda: jaxformer.init_params(jax.random.PRNGKey(0), config, dtype=dtype))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        base = 1.0 if jax.tree_util.keystr(path).endswith("['scale']") else 0.0
        return jnp.asarray(base + 0.05 * rng.standard_normal(leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def make_batch(config, B, T, mask, seed=0):
    """mask: None, "mostly_zero" (float, about 1 in 4 ones), "bool", "int" or "zeros"."""
    rng = np.random.default_rng(seed + 100)
    batch = {"inputs": jnp.asarray(rng.integers(0, config.vocab_size, (B, T)), jnp.int32),
             "targets": jnp.asarray(rng.integers(0, config.vocab_size, (B, T)), jnp.int32)}
    ones = rng.random((B, T)) < 0.25
    ones.flat[0] = True
    if mask == "mostly_zero":
        batch["mask"] = ones.astype(np.float64)
    elif mask == "bool":
        batch["mask"] = ones
    elif mask == "int":
        batch["mask"] = ones.astype(np.int32)
    elif mask == "zeros":
        batch["mask"] = np.zeros((B, T))
    return batch


WORDS = ("the quick brown fox jumps over a lazy dog while one small cat sat on the warm mat "
         "and birds sang in tall green trees").split()


def host_devices_flags(n: int) -> str:
    """XLA_FLAGS for a subprocess with ``n`` CPU devices, keeping the suite's own flags
    (conftest.py), so that it compiles as the test process does."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}".strip()


def write_corpus(path, lines=300, seed=0):
    """A small text with a simple word distribution: a few dozen steps learn it."""
    rng = random.Random(seed)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(lines)))
    return str(path)


def tiny_settings(corpus, **overrides):
    """TrainSettings of the tiny preset on ``corpus``: every step logged, no checkpoints."""
    values = dict(corpus=corpus, log_every=1, eval_every=10, eval_batches=2, ckpt_every=0)
    values.update(overrides)
    return settings_for("tiny", **values)


# ---------------------------------------------------------------- the memory options' covering table

LEAN_TINY = PRESETS["tiny"]  # D 16, 2 heads, 2 layers, F 24, max_seq_len 16
LEAN_FIELDS = {
    "attention_impl": ("full", "blockwise"),
    "attention_block": (4, 5),
    "loss_chunk": (0, 5),
    "remat": ("none", "block"),
    "norm": ("pre", "post"),
    "causal": (True, False),
    "positions": ("learned", "sinusoidal"),
    "activation": ("gelu", "gelu_tanh", "relu", "tanh"),
}
LEAN_BINARY = list(LEAN_FIELDS)[:-1]


def _lean_row(activation, bits):
    values = (LEAN_FIELDS[name][b] for name, b in zip(LEAN_BINARY, bits))
    return dict(zip(LEAN_BINARY, values), activation=activation)


def lean_covering_rows():
    """8 configs covering every pair of values of any two fields: for each activation a
    bit vector and its complement; the first vector is all zeros, the other three give
    the seven binary fields distinct 3-bit codes, so any two fields agree in one row
    and differ in another (and the complements supply the other two value pairs)."""
    codes = [(0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    vectors = [(0,) * 7] + [tuple(c[k] for c in codes) for k in range(3)]
    rows = []
    for activation, v in zip(LEAN_FIELDS["activation"], vectors):
        rows += [_lean_row(activation, v), _lean_row(activation, tuple(1 - b for b in v))]
    return rows


# (B, T, mask) per row: T = 1, T < block, T not a multiple of the block, T a multiple;
# B * T not a multiple of loss_chunk; every kind of mask
LEAN_SHAPES = [(2, 13, "mostly_zero"), (2, 13, None), (3, 3, "bool"), (2, 3, "int"),
               (2, 7, None), (3, 1, "mostly_zero"), (2, 12, "int"), (1, 9, "bool")]
LEAN_CASES = [(LEAN_TINY.replace(**row), *shape)
              for row, shape in zip(lean_covering_rows(), LEAN_SHAPES)]


def one_line_error(capsys, code, expected_code=2):
    """The single ``error: ...`` line a command wrote to stderr, after checking its exit
    code and that no traceback came with it."""
    err = capsys.readouterr().err
    assert code == expected_code, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


custom_vg = jax.jit(jax.value_and_grad(custom_vjp.loss_fn), static_argnums=2)


def THREE_SOURCES(params, batch, config, key):
    """(loss, grads) of jax.grad of the model, the manual backward and jax.grad of the custom_vjp
    model, each its own program (XLA compiles one program of all three up to a third longer)."""
    return tuple(f(params, batch, config, key=key) for f in (auto_vg, manual_vg, custom_vg))


def assert_sources_agree(config, B, T, mask, key):
    """In float64, the manual gradients and the custom_vjp model's equal jax.grad's: the loss
    to 1e-12, the gradient tree's structure, every leaf to 1e-10. Returns (params, batch, loss)."""
    params, batch = make_params(config, jnp.float64), make_batch(config, B, T, mask)
    (loss_ref, ref), *others = THREE_SOURCES(params, batch, config, key)
    for name, (loss, grads) in zip(("manual", "custom_vjp"), others):
        np.testing.assert_allclose(loss, loss_ref, rtol=1e-12, atol=1e-12, err_msg=name)
        assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(params), name
        check.assert_trees_close(ref, grads)  # 1e-10 per leaf in float64
    return params, batch, loss_ref


def decode_one_at_a_time(params, inputs, config, prompt, dtype=jnp.float64):
    """Logits (B, T, V) of the key/value-cache decoder: the first ``prompt`` positions in one
    call, then one token per call (jitted), concatenated along time."""
    from jaxformer.model.kv_cache import forward_cached, init_cache
    step = jax.jit(forward_cached, static_argnums=4)
    logits, cache = step(params, inputs[:, :prompt], init_cache(config, inputs.shape[0], dtype), 0, config)
    got = [logits]
    for t in range(prompt, inputs.shape[1]):
        logits, cache = step(params, inputs[:, t:t + 1], cache, t, config)
        got.append(logits)
    return np.concatenate(got, axis=1)


# ---------------------------------------------------------------- one computation per run


def once_per_run(tmp_path_factory, name: str, compute: Callable[[], dict]) -> dict:
    """compute()'s JSON result, computed once for the whole run and read by every pytest-xdist
    worker: a module fixture runs once per worker that gets one of its tests, so an expensive
    subprocess (the 8-device meshes) ran on both. The first worker computes under a file lock
    in the run's shared temporary folder; the others wait for it and read the file. A module
    that calls it is one xdist_group (tests/conftest.py), so that no worker waits: its tests all
    run on the worker that computes."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    path = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return json.loads(path.read_text())
        result = compute()
        path.write_text(json.dumps(result))
        return result


def run_cases_on_8_devices(module: str) -> dict:
    """``tests/{module}.py``'s ``run_cases()`` in a subprocess on 8 forced CPU devices in float64,
    its JSON result. The programs are tiny: neither JAX nor XLA need optimize them (compiling is
    most of the run; the settings conftest.py gives the suite halve it)."""
    tests = pathlib.Path(__file__).resolve().parent
    flags = ("--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
             f"--xla_llvm_disable_expensive_passes=true {suite_flags()}").strip()
    env = {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "JAX_ENABLE_X64": "1", "JAX_DISABLE_MOST_OPTIMIZATIONS": "true",
           "PATH": "/usr/bin:/bin"}
    code = f"import sys; sys.path.insert(0, {str(tests)!r}); import json, {module} as t; " \
           "print('RESULTS', json.dumps(t.run_cases()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tests.parent, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


def adapter_differences(name: str, config, mesh, inputs, segments=None, seed: int = 3, dropout: float = 0.0) -> dict:
    """LoRA adapters (rank 2, A and B random) on every projection of a random ``config`` base:
    the adapters' loss and gradient by hand (manual_grads.adapters.value_and_grad) and by jax.grad
    of lora_loss_fn under ``jax.set_mesh(mesh)``, against one device's manual ones:
    {f"{name}: leaves", f"{name}: {source} loss", f"{name}: {source} = one device"}; with the
    adapters' ``dropout`` (one step key for every source) also f"{name}: dropout's effect", the
    one-device loss' change without the key."""
    from jaxformer.model import lora
    from jaxformer.model.params import init_params
    from jaxformer.training.adapters import lora_loss_fn
    from manual_grads import adapters as manual_adapters

    rng, leaves = np.random.default_rng(seed), jax.tree_util.tree_leaves
    random = lambda tree: jax.tree_util.tree_map(lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape)), tree)  # noqa: E731
    base = random(jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config)))
    lc = lora.LoraConfig(rank=2, alpha=3.0, targets="all", dropout=dropout)
    adapters = random(lora.init_adapters(jax.random.PRNGKey(1), base, lc))  # B random too: a zero B hides dA
    batch = {"inputs": inputs, "targets": jnp.roll(inputs, -1, axis=1)}
    if segments is not None:
        batch["segments"] = segments
    key = (jax.random.PRNGKey(9),) if dropout else ()  # the step's key: the adapters' masks
    step = lambda f: jax.jit(f, static_argnums=(3, 4))  # noqa: E731
    loss1, grads1 = step(manual_adapters.value_and_grad)(adapters, batch, base, config, lc, *key)
    out = {f"{name}: leaves": len(leaves(grads1))}
    if dropout:  # the masks drop something: without them the loss is another
        out[f"{name}: dropout's effect"] = abs(float(loss1) - float(step(lora_loss_fn)(adapters, batch, base, config, lc)))
    with jax.set_mesh(mesh):
        for source, f in (("manual", manual_adapters.value_and_grad), ("jax.grad", jax.value_and_grad(lora_loss_fn))):
            loss, grads = step(f)(adapters, batch, base, config, lc, *key)
            out[f"{name}: {source} loss"] = abs(float(loss) - float(loss1))
            out[f"{name}: {source} = one device"] = max(
                float(jnp.max(jnp.abs(a - b))) for a, b in zip(leaves(grads), leaves(grads1), strict=True))
    return out


def assert_adapters_equal_one_device(results: dict, name: str, n_leaves: int, tol: float = 1e-10) -> None:
    """adapter_differences' result: every leaf compared, both sources' loss and leaves within ``tol``
    (and with dropout, masks that change the loss)."""
    assert results[f"{name}: leaves"] == n_leaves
    for source in ("manual", "jax.grad"):
        assert results[f"{name}: {source} loss"] <= tol, source
        assert results[f"{name}: {source} = one device"] <= tol, source
    if f"{name}: dropout's effect" in results:
        assert results[f"{name}: dropout's effect"] > 1e-3
