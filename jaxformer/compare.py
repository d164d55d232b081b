"""The main job: hand-derived gradients against ``jax.grad``, preset by preset.

For each preset, on one batch of the embedded corpus, both gradient sources run
jitted (config static):

    manual     manual_grads.value_and_grad(params, batch, config)
    autodiff   jax.value_and_grad(jaxformer.loss_fn)(params, batch, config)

and every parameter leaf is compared with ``manual_grads.check.compare_trees``
against the tolerance of the dtype (``check.tolerance_for``). With ``--fd`` the
manual gradient is also checked in float64 against central finite differences of
the loss (``check.finite_difference_check``) along random directions inside each
leaf and over the whole tree.

Output: a table per preset in the terminal, and ``report.json``, ``report.md``
and ``rel_errors.png`` in the output folder. ``main`` returns 1 and names the
leaf when any leaf is over tolerance, 0 when all pass.

    python experiments/compare_grads.py                      # loopos, sunfish, cllm in float32
    python experiments/compare_grads.py --dtype float64 --fd
    jaxformer compare-grads --preset tiny --repeats 3

A gradient source is any ``(params, batch, config) -> (loss, grads)`` with
config static under jit; ``run_comparison`` and ``main`` take one as
``manual_fn``, so a deliberately broken source can show that the job fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.config import PRESETS, ModelConfig
from jaxformer.model import loss_fn
from jaxformer.params import count_params, init_params

DEFAULT_PRESETS = ("loopos", "sunfish", "cllm")  # the three systems the project grew from
FD_TOLERANCE = 1e-6  # relative error allowed between finite differences and the manual gradient
FD_EPS = 1e-5  # step of the central differences (float64), check.finite_difference_check's
FD_ROUNDOFF_ULPS = 8  # round-off of one float64 loss evaluation, in units of eps * |loss|
FD_DIRECTIONS = 3  # random directions per leaf
FD_MAX_HALVINGS = 4  # the step may shrink to eps / 16 to step off a kink of the loss

SOURCE_AUTO = "manual vs autodiff"
SOURCE_FD = "finite differences vs manual (float64)"

GradFn = Callable[[Any, dict, ModelConfig], tuple]  # (params, batch, config) -> (loss, grads)


# ----------------------------------------------------------------------------
# gradient sources


def manual_value_and_grad() -> GradFn:
    """``manual_grads.value_and_grad``, imported here (manual_grads imports jaxformer)."""
    from manual_grads import value_and_grad

    return value_and_grad


def autodiff_value_and_grad(params, batch, config: ModelConfig):
    """The reference: ``jax.value_and_grad(loss_fn)``."""
    from manual_grads import check

    return check.autodiff_value_and_grad(loss_fn, params, batch, config)


# ----------------------------------------------------------------------------
# inputs


def make_batch(config: ModelConfig, batch_size: int, seq_len: int, seed: int) -> dict:
    """Batch 0 of the embedded corpus, byte-tokenized: {"inputs", "targets"} int32 (B, T)."""
    from jaxformer.data import Batcher, ByteTokenizer, load_corpus

    tokenizer = ByteTokenizer()
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(f"the byte tokenizer has {tokenizer.vocab_size} tokens, "
                         f"the config {config.vocab_size}")
    ids = tokenizer.encode(load_corpus("default"))
    batch = Batcher(ids, batch_size, seq_len, seed).batch(0)
    return {k: jnp.asarray(v) for k, v in batch.items()}


def dotted(keystr: str) -> str:
    """"['blocks']['attn']['wq']" -> "blocks.attn.wq"."""
    parts = re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)", keystr)
    return ".".join(next(p for p in groups if p) for groups in parts) or keystr


def block_of(path: str) -> str:
    """The group a leaf is summarized in: "blocks.attn.wq" -> "blocks.attn", "head.w" -> "head"."""
    parts = path.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" and len(parts) > 2 else parts[0]


# Parameter names in the order the model uses them (DESIGN.md's tree): embeddings, blocks
# (ln1, attn, ln2, ffn), final norm, head. jax flattens dicts in sorted-key order instead.
MODEL_ORDER = ("tok_embed", "pos_embed", "blocks", "ln1", "attn", "ln2", "ffn", "ln_f", "head",
               "wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo", "w_in", "b_in", "w_out", "b_out",
               "scale", "bias", "w", "b")


def model_order_key(path: str) -> tuple:
    """Sort key putting dotted leaf paths in model order; unknown names go last, by name."""
    rank = {name: i for i, name in enumerate(MODEL_ORDER)}
    return tuple((rank.get(part, len(rank)), part) for part in path.split("."))


# ----------------------------------------------------------------------------
# timing


@dataclasses.dataclass
class Timing:
    compile_s: float  # trace + lower + XLA compile of the jitted function
    step_s: float  # median wall time of one call, after a warm-up call
    steps_s: list  # every timed call

    def to_dict(self):
        return dataclasses.asdict(self)


def compile_fn(fn: GradFn, params, batch, config: ModelConfig):
    """Jit ``fn`` with config static and compile it for these inputs; returns the
    compiled function of (params, batch) and the seconds spent tracing and compiling
    (near zero when this process already compiled the same function for the same shapes:
    jax's in-memory cache answers)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn, static_argnums=2).lower(params, batch, config).compile()
    return compiled, time.perf_counter() - t0


def time_calls(fns: Sequence[Callable], args: tuple, repeats: int) -> list[list[float]]:
    """Wall time of ``repeats`` calls of each function, each waited on with
    block_until_ready. The calls alternate (f, g, f, g, ...) so that a change in the
    machine's load hits every function alike, and the ratio of medians stays fair."""
    times = [[] for _ in fns]
    for _ in range(max(repeats, 1)):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts.append(time.perf_counter() - t0)
    return times


# ----------------------------------------------------------------------------
# finite differences


def _rank(rel) -> float:
    """Sort key of a relative error: NaN ranks above everything."""
    rel = float(rel)
    return math.inf if math.isnan(rel) else rel


def _fd_rel(numeric: float, analytic: float, floor: float) -> float:
    """|numeric - analytic| / max(|numeric|, |analytic|, floor)."""
    return abs(numeric - analytic) / max(abs(numeric), abs(analytic), floor)


def fd_floor(eps: float, grad_floor: float, loss_abs: float) -> float:
    """The floor of the finite differences' relative error at step ``eps``: the larger of
    ``grad_floor`` and the round-off of the difference quotient divided by the tolerance,
    FD_ROUNDOFF_ULPS * eps_float64 * |loss| / eps / FD_TOLERANCE (below it, central
    differences at that step resolve nothing)."""
    roundoff = FD_ROUNDOFF_ULPS * np.finfo(np.float64).eps * loss_abs / eps
    return max(grad_floor, roundoff / FD_TOLERANCE, np.finfo(np.float64).tiny)


def fd_along(loss: Callable, params, grads, key, eps: float, grad_floor: float,
             loss_abs: float) -> dict:
    """Finite differences along one random unit direction (fixed by ``key``):
    ``check.finite_difference_check`` at steps eps, eps/2, eps/4, ... until two successive
    estimates agree to FD_TOLERANCE, so a step that straddles a kink of the loss (a ReLU
    pre-activation within eps of zero) is replaced by a smaller one. Only the numeric
    estimates choose the step, never the gradient under test."""
    from manual_grads import check

    (prev,) = check.finite_difference_check(loss, params, grads, key, 1, eps)
    used = eps
    for _ in range(FD_MAX_HALVINGS):
        (cur,) = check.finite_difference_check(loss, params, grads, key, 1, used / 2)
        agree = FD_TOLERANCE * max(abs(cur.numeric), fd_floor(used / 2, grad_floor, loss_abs))
        if abs(cur.numeric - prev.numeric) <= agree:
            break
        prev, used = cur, used / 2
    floor = fd_floor(used, grad_floor, loss_abs)
    rel = _fd_rel(prev.numeric, prev.analytic, floor)
    return dict(numeric=prev.numeric, analytic=prev.analytic, rel=rel, eps=used, floor=floor,
                passed=bool(rel <= FD_TOLERANCE))


def finite_difference_leaves(params64, grads64, batch, config: ModelConfig, key,
                             n_directions: int = FD_DIRECTIONS, eps: float = FD_EPS) -> dict:
    """Float64 finite differences of the loss (``fd_along``) along ``n_directions`` random
    unit directions inside each leaf, and along directions over the whole tree, against
    the manual gradient; JSON-ready, worst direction per leaf.

    The relative error's denominator has a floor (``fd_floor``): at least FLOOR_FRAC *
    global gradient norm, as in check.compare_trees, so a leaf whose true gradient is zero
    (the attention key bias) is not judged against zero; at least what round-off lets
    central differences resolve.
    """
    from manual_grads import check

    loss64 = jax.jit(loss_fn, static_argnums=2)
    leaves_p, treedef = jax.tree_util.tree_flatten_with_path(params64)
    leaves_g = jax.tree_util.tree_leaves(grads64)
    global_norm = math.sqrt(sum(float(jnp.sum(g * g)) for g in leaves_g))
    loss_abs = abs(float(loss64(params64, batch, config)))
    grad_floor = check.FLOOR_FRAC * global_norm
    plain = [leaf for _, leaf in leaves_p]

    def with_leaf(i, x):
        return jax.tree_util.tree_unflatten(treedef, plain[:i] + [x] + plain[i + 1:])

    rows = []
    keys = jax.random.split(key, len(plain) + 1)
    for i, ((path, leaf), grad) in enumerate(zip(leaves_p, leaves_g)):
        loss_i = lambda x, i=i: loss64(with_leaf(i, x), batch, config)  # noqa: E731
        checks = [fd_along(loss_i, leaf, grad, k, eps, grad_floor, loss_abs)
                  for k in jax.random.split(keys[i], n_directions)]
        worst = max(checks, key=lambda d: _rank(d["rel"]))
        rows.append(dict(path=dotted(jax.tree_util.keystr(path)), **worst))
    whole = [fd_along(lambda p: loss64(p, batch, config), params64, grads64, k, eps,
                      grad_floor, loss_abs) for k in jax.random.split(keys[-1], n_directions)]
    return dict(tolerance=FD_TOLERANCE, eps=eps, n_directions=n_directions,
                floor=fd_floor(eps, grad_floor, loss_abs), global_norm=global_norm,
                leaves=rows, whole_tree=whole,
                passed=all(r["passed"] for r in rows) and all(w["passed"] for w in whole))


# ----------------------------------------------------------------------------
# one preset


@dataclasses.dataclass
class PresetReport:
    preset: str
    config: dict
    n_params: int
    dtype: str
    tolerance: float  # relative tolerance per leaf, check.tolerance_for(dtype)
    batch_size: int
    seq_len: int
    loss: dict  # manual, auto, rel, passed
    leaves: list  # one dict per leaf, model order: path, shape, max_abs, rel, cosine, passed
    blocks: list  # one dict per group: block, n_leaves, worst_leaf, worst_rel, passed
    timings: dict  # manual, auto (Timing dicts), ratio_step, ratio_compile (manual / auto)
    fd: dict | None  # finite_difference_leaves(...) or None
    failures: list  # one line per failing leaf / check, naming it
    passed: bool

    def to_dict(self):
        return dataclasses.asdict(self)


def run_comparison(config: ModelConfig, params, batch, *, name: str = "", repeats: int = 5,
                   fd: bool = False, fd_directions: int = FD_DIRECTIONS, seed: int = 0,
                   manual_fn: GradFn | None = None, auto_fn: GradFn | None = None) -> PresetReport:
    """Compare ``manual_fn`` (default: manual_grads.value_and_grad) with ``auto_fn``
    (default: jax.value_and_grad(loss_fn)) on ``params`` and ``batch``, both jitted."""
    from manual_grads import check

    manual_fn = manual_fn or manual_value_and_grad()
    auto_fn = auto_fn or autodiff_value_and_grad
    dtype = jnp.dtype(jax.tree_util.tree_leaves(params)[0].dtype).name
    tol = check.tolerance_for(dtype)

    manual_c, compile_m = compile_fn(manual_fn, params, batch, config)
    auto_c, compile_a = compile_fn(auto_fn, params, batch, config)
    loss_m, grads_m = jax.block_until_ready(manual_c(params, batch))  # also the warm-up calls
    loss_a, grads_a = jax.block_until_ready(auto_c(params, batch))
    steps_m, steps_a = time_calls([manual_c, auto_c], (params, batch), repeats)
    t_manual = Timing(compile_m, statistics.median(steps_m), steps_m)
    t_auto = Timing(compile_a, statistics.median(steps_a), steps_a)

    failures = []
    loss_m, loss_a = float(loss_m), float(loss_a)
    loss_rel = abs(loss_m - loss_a) / max(abs(loss_a), np.finfo(np.float64).tiny)
    loss = dict(manual=loss_m, auto=loss_a, rel=loss_rel, passed=bool(loss_rel <= tol))
    if not loss["passed"]:
        failures.append(f"loss: manual {loss_m:.9e} vs autodiff {loss_a:.9e}, "
                        f"rel {loss_rel:.2e} > tolerance {tol:.0e}")

    try:
        comparisons = check.compare_trees(grads_a, grads_m)
    except ValueError as err:  # a missing or misshapen leaf
        comparisons = []
        failures.append(str(err))
    leaves = sorted(
        (dict(path=dotted(c.path), shape=list(c.shape), max_abs=c.max_abs, rel=c.rel,
              cosine=c.cosine, ref_norm=c.ref_norm, passed=bool(c.rel <= tol))
         for c in comparisons),
        key=lambda r: model_order_key(r["path"]))
    for r in leaves:
        if not r["passed"]:
            failures.append(f"{r['path']} {tuple(r['shape'])}: rel {r['rel']:.2e} > tolerance "
                            f"{tol:.0e} (max abs {r['max_abs']:.2e}, cosine {r['cosine']:.9f})")

    blocks = {}
    for r in leaves:
        b = blocks.setdefault(block_of(r["path"]), dict(block=block_of(r["path"]), n_leaves=0,
                                                        worst_leaf=r["path"], worst_rel=-1.0,
                                                        passed=True))
        b["n_leaves"] += 1
        b["passed"] &= r["passed"]
        if _rank(r["rel"]) > _rank(b["worst_rel"]):
            b["worst_leaf"], b["worst_rel"] = r["path"], r["rel"]
    blocks = list(blocks.values())

    fd_result = None
    if fd:
        if not jax.config.jax_enable_x64:
            raise RuntimeError("finite differences run in float64: enable jax_enable_x64 first")
        params64 = jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), params)
        if dtype == "float64":
            grads64 = grads_m
        else:
            _, grads64 = jax.jit(manual_fn, static_argnums=2)(params64, batch, config)
        fd_result = finite_difference_leaves(params64, grads64, batch, config,
                                             jax.random.PRNGKey(seed + 1), fd_directions)
        for r in fd_result["leaves"]:
            if not r["passed"]:
                failures.append(f"{r['path']}: finite differences {r['numeric']:.9e} vs manual "
                                f"{r['analytic']:.9e}, rel {r['rel']:.2e} > {FD_TOLERANCE:.0e}")
        for i, w in enumerate(fd_result["whole_tree"]):
            if not w["passed"]:
                failures.append(f"whole tree, direction {i}: finite differences rel "
                                f"{w['rel']:.2e} > {FD_TOLERANCE:.0e}")

    timings = dict(manual=t_manual.to_dict(), auto=t_auto.to_dict(),
                   ratio_step=t_manual.step_s / t_auto.step_s,
                   ratio_compile=t_manual.compile_s / max(t_auto.compile_s, 1e-9))
    return PresetReport(
        preset=name, config=config.to_dict(), n_params=count_params(params), dtype=dtype,
        tolerance=tol, batch_size=int(batch["inputs"].shape[0]),
        seq_len=int(batch["inputs"].shape[1]), loss=loss, leaves=leaves, blocks=blocks,
        timings=timings, fd=fd_result, failures=failures, passed=not failures)


def compare_preset(name: str, *, dtype: str = "float32", batch_size: int = 4, seq_len: int = 32,
                   seed: int = 0, repeats: int = 5, fd: bool = False,
                   fd_directions: int = FD_DIRECTIONS,
                   manual_fn: GradFn | None = None) -> PresetReport:
    """Build the preset's params (seed) and a corpus batch, then ``run_comparison``. The
    sequence length is cut to the preset's max_seq_len when longer."""
    config = PRESETS[name]
    params = init_params(jax.random.PRNGKey(seed), config, dtype)
    got = jnp.dtype(jax.tree_util.tree_leaves(params)[0].dtype).name
    if got != dtype:
        raise RuntimeError(f"asked for {dtype} params, got {got}: float64 needs jax_enable_x64")
    batch = make_batch(config, batch_size, min(seq_len, config.max_seq_len), seed)
    return run_comparison(config, params, batch, name=name, repeats=repeats, fd=fd,
                          fd_directions=fd_directions, seed=seed, manual_fn=manual_fn)


# ----------------------------------------------------------------------------
# terminal output


def _use_color(stream) -> bool:
    return hasattr(stream, "isatty") and stream.isatty() and "NO_COLOR" not in os.environ


def _status(passed: bool, color: bool) -> str:
    word = "PASS" if passed else "FAIL"
    if not color:
        return word
    return f"\033[1;32m{word}\033[0m" if passed else f"\033[1;31m{word}\033[0m"


def _sci(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}e}" if math.isfinite(x) else str(x)


def _shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.3f} ms"


def describe_config(c: dict) -> str:
    return (f"{c['norm']}-LN, {c['activation']}, {c['positions']} positions, "
            f"L={c['n_layers']} D={c['d_model']} H={c['n_heads']} F={c['d_ff']} V={c['vocab_size']}")


def format_preset(r: PresetReport, color: bool = False) -> str:
    """The terminal table of one preset: leaves, blocks, timings, finite differences."""
    rule = "-" * 96
    lines = [
        "=" * 96,
        f"{r.preset}: {describe_config(r.config)}; {r.n_params:,} params",
        f"{r.dtype}, batch {r.batch_size} x {r.seq_len}, tolerance {r.tolerance:.0e} (relative, per leaf)",
        f"loss: manual {r.loss['manual']:.9e}   autodiff {r.loss['auto']:.9e}   "
        f"rel {_sci(r.loss['rel'])}   {_status(r.loss['passed'], color)}",
        rule,
    ]
    width = max([len(x["path"]) for x in r.leaves] + [4])
    lines.append(f"{'leaf':<{width}}  {'shape':<14} {'max abs err':>11}  {'rel err':>9}  "
                 f"{'cosine':>15}  {'':4}")
    fd_rel = {x["path"]: x["rel"] for x in (r.fd or {}).get("leaves", [])}
    if r.fd:
        lines[-1] += f"  {'fd rel':>9}"
    for x in r.leaves:
        line = (f"{x['path']:<{width}}  {_shape(x['shape']):<14} {_sci(x['max_abs']):>11}  "
                f"{_sci(x['rel']):>9}  {x['cosine']:>15.12f}  {_status(x['passed'], color)}")
        if r.fd and x["path"] in fd_rel:
            line += f"  {_sci(fd_rel[x['path']]):>9}"
        lines.append(line)
    lines.append(rule)
    bw = max([len(b["block"]) for b in r.blocks] + [5])
    lines.append(f"{'block':<{bw}}  {'leaves':>6}  {'worst rel':>9}  {'worst leaf':<{width}}")
    for b in r.blocks:
        lines.append(f"{b['block']:<{bw}}  {b['n_leaves']:>6}  {_sci(b['worst_rel']):>9}  "
                     f"{b['worst_leaf']:<{width}}  {_status(b['passed'], color)}")
    lines.append(rule)
    t = r.timings
    n = len(t["manual"]["steps_s"])
    lines += [
        f"{'timing':<10}  {'compile':>10}  {'step (median of ' + str(n) + ')':>20}",
        f"{'manual':<10}  {t['manual']['compile_s']:>8.2f} s  {_ms(t['manual']['step_s']):>20}",
        f"{'autodiff':<10}  {t['auto']['compile_s']:>8.2f} s  {_ms(t['auto']['step_s']):>20}",
        f"{'ratio':<10}  {t['ratio_compile']:>8.2f} x  {t['ratio_step']:>18.2f} x   (manual / autodiff)",
    ]
    if r.fd:
        checks = r.fd["leaves"] + r.fd["whole_tree"]
        worst = max(checks, key=lambda x: _rank(x["rel"]))
        smaller = sum(x["eps"] < r.fd["eps"] for x in checks)
        lines += [rule, (
            f"finite differences (float64, eps {r.fd['eps']:g}, {r.fd['n_directions']} "
            f"directions per leaf and over the whole tree): worst rel {_sci(worst['rel'])} at "
            f"{worst.get('path', 'whole tree')}, tolerance {r.fd['tolerance']:.0e}  "
            f"{_status(r.fd['passed'], color)}")]
        if smaller:
            lines.append(f"  (step reduced, down to {min(x['eps'] for x in checks):g}, in {smaller} "
                         f"of the {len(checks)} directions shown, where the loss has a kink "
                         f"within eps)")
    worst = max(r.leaves, key=lambda x: _rank(x["rel"]), default=None)
    summary = f"{r.preset}: {_status(r.passed, color)}"
    if worst is not None:
        summary += (f"  ({len(r.leaves)} leaves, worst rel {_sci(worst['rel'])} at "
                    f"{worst['path']}, tolerance {r.tolerance:.0e})")
    lines += [rule, summary]
    lines += [f"  over tolerance: {f}" for f in r.failures]
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# report files


def _json_safe(x):
    """Non-finite floats as strings ("nan", "inf"): the file stays strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def build_report(reports: Sequence[PresetReport], options: dict) -> dict:
    device = jax.devices()[0]
    return dict(
        passed=all(r.passed for r in reports),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        options=options,
        environment=dict(jax=jax.__version__, backend=jax.default_backend(),
                         device=str(device), python=sys.version.split()[0]),
        presets=[r.to_dict() for r in reports],
    )


def format_markdown(report: dict) -> str:
    yes = lambda ok: "PASS" if ok else "**FAIL**"  # noqa: E731
    lines = [
        "# Manual gradients vs jax.grad",
        "",
        f"Overall: **{'PASS' if report['passed'] else 'FAIL'}**  ",
        f"Created {report['created']}; jax {report['environment']['jax']} on "
        f"{report['environment']['device']}.  ",
        "Options: " + ", ".join(f"`{k}={v}`" for k, v in report["options"].items()),
        "",
        "| preset | dtype | leaves | worst rel err | worst leaf | tolerance | step manual / auto | result |",
        "|---|---|---:|---:|---|---:|---:|---|",
    ]
    for p in report["presets"]:
        worst = max(p["leaves"], key=lambda x: _rank(x["rel"]), default=dict(rel=math.nan, path="-"))
        lines.append(f"| {p['preset']} | {p['dtype']} | {len(p['leaves'])} | {_sci(_num(worst['rel']))} "
                     f"| `{worst['path']}` | {p['tolerance']:.0e} | {p['timings']['ratio_step']:.2f} x "
                     f"| {yes(p['passed'])} |")
    for p in report["presets"]:
        t = p["timings"]
        lines += [
            "", f"## {p['preset']}: {yes(p['passed'])}", "",
            f"{describe_config(p['config'])}; {p['n_params']:,} params; {p['dtype']}; "
            f"batch {p['batch_size']} x {p['seq_len']}; tolerance {p['tolerance']:.0e}.",
            "",
            f"Loss: manual {_num(p['loss']['manual']):.9e}, autodiff {_num(p['loss']['auto']):.9e}, "
            f"rel {_sci(_num(p['loss']['rel']))}.",
            "",
        ]
        if p["failures"]:
            lines += ["Over tolerance:", ""] + [f"- `{f}`" for f in p["failures"]] + [""]
        fd_rel = {x["path"]: x["rel"] for x in (p["fd"] or {}).get("leaves", [])}
        head = "| leaf | shape | max abs err | rel err | cosine | result |"
        sep = "|---|---|---:|---:|---:|---|"
        if p["fd"]:
            head, sep = head + " fd rel err |", sep + "---:|"
        lines += [head, sep]
        for x in p["leaves"]:
            row = (f"| `{x['path']}` | {_shape(x['shape'])} | {_sci(_num(x['max_abs']))} | "
                   f"{_sci(_num(x['rel']))} | {_num(x['cosine']):.12f} | {yes(x['passed'])} |")
            if p["fd"]:
                row += f" {_sci(_num(fd_rel.get(x['path'], math.nan)))} |"
            lines.append(row)
        lines += ["", "| block | leaves | worst rel err | worst leaf | result |",
                  "|---|---:|---:|---|---|"]
        for b in p["blocks"]:
            lines.append(f"| {b['block']} | {b['n_leaves']} | {_sci(_num(b['worst_rel']))} | "
                         f"`{b['worst_leaf']}` | {yes(b['passed'])} |")
        lines += [
            "", f"| timing | compile (s) | step, median of {len(t['manual']['steps_s'])} (ms) |",
            "|---|---:|---:|",
            f"| manual | {t['manual']['compile_s']:.2f} | {t['manual']['step_s'] * 1e3:.3f} |",
            f"| autodiff | {t['auto']['compile_s']:.2f} | {t['auto']['step_s'] * 1e3:.3f} |",
            f"| manual / autodiff | {t['ratio_compile']:.2f} x | {t['ratio_step']:.2f} x |",
        ]
        if p["fd"]:
            fd = p["fd"]
            lines += ["", f"Finite differences (float64 central differences, eps {fd['eps']:g}, "
                      f"{fd['n_directions']} random unit directions per leaf, tolerance "
                      f"{fd['tolerance']:.0e}, floor {fd['floor']:.1e}): "
                      f"{yes(fd['passed'])}; over the whole tree: "
                      + ", ".join(_sci(_num(w["rel"])) for w in fd["whole_tree"]) + "."]
    lines += ["", "![relative error per leaf](rel_errors.png)", ""]
    return "\n".join(lines)


def _num(x) -> float:
    return float(x)  # also reads back "nan" / "inf" from _json_safe


def plot_report(report: dict, path: Path) -> None:
    """Relative error per leaf on a log axis, one panel per preset, one color per source."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    presets = report["presets"]
    n_leaves = max([len(p["leaves"]) for p in presets] + [1])
    fig = Figure(figsize=(max(8.0, 0.38 * n_leaves + 2), 3.6 * len(presets)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(presets), 1, squeeze=False)[:, 0]
    for ax, p in zip(axes, presets):
        paths = [x["path"] for x in p["leaves"]]
        xs = np.arange(len(paths))
        fd_rel = {x["path"]: x["rel"] for x in (p["fd"] or {}).get("leaves", [])}
        series = [(SOURCE_AUTO, [_num(x["rel"]) for x in p["leaves"]], "o", "tab:blue",
                   p["tolerance"], f"tolerance {p['dtype']}", "--")]
        if p["fd"]:
            series.append((SOURCE_FD, [_num(fd_rel.get(q, math.nan)) for q in paths], "^",
                           "tab:orange", p["fd"]["tolerance"], "tolerance finite differences", ":"))
        # exact zeros (both sources ran the same floating-point operations) and NaNs cannot
        # sit on a log axis: zeros are drawn hollow a decade below the smallest value, NaNs
        # hollow at the top.
        finite = [v for _, ys, *_ in series for v in ys if math.isfinite(v) and v > 0]
        low = 10 ** (math.floor(math.log10(min(finite + [p["tolerance"]]))) - 1)
        high = 10 ** (math.ceil(math.log10(max(finite + [p["tolerance"]]))) + 1)
        for label, ys, marker, color, tol, tol_label, ls in series:
            ok = [i for i, v in enumerate(ys) if math.isfinite(v) and v > 0]
            ax.scatter(xs[ok], [ys[i] for i in ok], marker=marker, s=28, color=color,
                       label=label, zorder=3)
            zero = [i for i, v in enumerate(ys) if v == 0]
            if zero:
                ax.scatter(xs[zero], [low] * len(zero), marker=marker, s=28, facecolors="none",
                           edgecolors=color, label=f"{label}: exactly 0", zorder=3)
            bad = [i for i, v in enumerate(ys) if not math.isfinite(v)]
            if bad:
                ax.scatter(xs[bad], [high] * len(bad), marker="x", s=40, color="tab:red",
                           label=f"{label}: not finite", zorder=3)
            ax.axhline(tol, color=color, ls=ls, lw=1, label=f"{tol_label} ({tol:.0e})")
        ax.set_yscale("log")
        ax.set_xticks(xs, paths, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("relative error")
        ax.set_title(f"{p['preset']} ({p['dtype']}): {'PASS' if p['passed'] else 'FAIL'}",
                     loc="left", fontsize=10)
        ax.grid(True, axis="y", which="major", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=110)


def write_reports(report: dict, out: str | os.PathLike) -> dict:
    """report.json, report.md and rel_errors.png in ``out`` (created); returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = dict(json=out / "report.json", markdown=out / "report.md", png=out / "rel_errors.png")
    paths["json"].write_text(json.dumps(_json_safe(report), indent=2) + "\n")
    paths["markdown"].write_text(format_markdown(_json_safe(report)))
    plot_report(_json_safe(report), paths["png"])
    return paths


# ----------------------------------------------------------------------------
# command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "compare_grads.py"
    parser = argparse.ArgumentParser(
        prog="jaxformer compare-grads" if prog == "jaxformer" else prog,
        description="Compare the hand-derived gradients (manual_grads) with jax.grad, leaf by "
                    "leaf, for each preset; write JSON, Markdown and PNG reports. Exits 1 "
                    "naming the leaf when any gradient is over tolerance.")
    parser.add_argument("--preset", nargs="+", action="extend", choices=sorted(PRESETS),
                        metavar="NAME", help=f"one or more of {', '.join(PRESETS)} "
                        f"(default: {' '.join(DEFAULT_PRESETS)})")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                        help="dtype of params and gradients (float64 turns on jax_enable_x64); "
                             "default float32")
    parser.add_argument("--fd", action="store_true",
                        help="also check the manual gradient of every leaf against float64 "
                             f"finite differences (relative tolerance {FD_TOLERANCE:.0e})")
    parser.add_argument("--fd-directions", metavar="N", type=int, default=FD_DIRECTIONS,
                        help=f"random directions per leaf for --fd (default {FD_DIRECTIONS})")
    parser.add_argument("--batch-size", metavar="B", type=int, default=4,
                        help="sequences per batch (default 4)")
    parser.add_argument("--seq-len", metavar="T", type=int, default=32,
                        help="tokens per sequence, cut to the preset's max_seq_len (default 32)")
    parser.add_argument("--seed", metavar="N", type=int, default=0,
                        help="params and batch seed (default 0)")
    parser.add_argument("--repeats", metavar="N", type=int, default=10,
                        help="timed calls of each jitted gradient (default 10)")
    parser.add_argument("--out", metavar="DIR", default="runs/compare_grads",
                        help="folder for report.json, report.md, rel_errors.png "
                             "(default runs/compare_grads)")
    args = parser.parse_args(argv)
    for name in ("batch_size", "seq_len", "repeats", "fd_directions"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    args.preset = list(dict.fromkeys(args.preset or DEFAULT_PRESETS))
    return args


def main(argv: Sequence[str] | None = None, manual_fn: GradFn | None = None) -> int:
    """Run the comparison; 0 when every leaf of every preset passes, 1 otherwise."""
    args = parse_args(argv)
    if args.dtype == "float64" or args.fd:
        jax.config.update("jax_enable_x64", True)  # before anything is traced
    color = _use_color(sys.stdout)
    reports = []
    for name in args.preset:
        if sys.stderr.isatty():
            print(f"{name}: compiling and timing both gradients ({args.dtype}) ...",
                  file=sys.stderr, flush=True)
        r = compare_preset(name, dtype=args.dtype, batch_size=args.batch_size,
                           seq_len=args.seq_len, seed=args.seed, repeats=args.repeats,
                           fd=args.fd, fd_directions=args.fd_directions, manual_fn=manual_fn)
        print(format_preset(r, color), flush=True)
        reports.append(r)
    options = {k: v for k, v in vars(args).items()}
    report = build_report(reports, options)
    paths = write_reports(report, args.out)
    print("=" * 96)
    for r in reports:
        print(f"  {r.preset:<10} {_status(r.passed, color)}")
    print(f"overall: {_status(report['passed'], color)}   reports: "
          + ", ".join(str(p) for p in paths.values()))
    if not report["passed"]:
        for r in reports:
            for f in r.failures:
                print(f"FAIL {r.preset}: {f}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
