"""Reporting for the gradient comparison (``tools.compare.grads``): the terminal table of a
preset, the JSON and Markdown report files (the PNG is ``compare_plot``'s).

Everything here reads a ``compare.PresetReport`` (or its ``to_dict()``); nothing
computes a gradient.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
from pathlib import Path
from typing import Sequence

import jax

from jaxformer.observe.jsonsafe import json_safe, write_json
from jaxformer.observe.words import plural
from jaxformer.tools.compare.plot import plot_report
from jaxformer.tools.compare.leaves import error_rank


# ----------------------------------------------------------------------------
# terminal output


def use_color(stream) -> bool:
    """Whether to color PASS / FAIL on ``stream``: a terminal, and NO_COLOR not set."""
    return hasattr(stream, "isatty") and stream.isatty() and "NO_COLOR" not in os.environ


def status(passed: bool, color: bool) -> str:
    """PASS or FAIL, green or red when ``color``."""
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


def criterion(dtype: str, tolerance: float, mixed: dict | None) -> str:
    """How a leaf passes, in words."""
    if not mixed:
        return f"{dtype}, tolerance {tolerance:.0e} (relative, per leaf)"
    return (f"{dtype} params, products in {mixed['compute_dtype']}: a leaf passes when its "
            f"error vs the {dtype} reference is <= {mixed['factor']:g} x max(autodiff's, "
            f"{mixed['floor']:.1e})")


def _mixed_loss(loss: dict) -> str:
    return (f"   vs reference: manual {_sci(loss['manual_ref_rel'])} autodiff "
            f"{_sci(loss['auto_ref_rel'])}" if "manual_ref_rel" in loss else "")


def format_preset(r, color: bool = False) -> str:
    """The terminal table of one preset: leaves, blocks, timings, finite differences. With
    mixed precision each leaf also shows the error of each source vs the reference."""
    rule = "-" * 96
    mixed = getattr(r, "mixed", None)
    lines = [
        "=" * 96,
        f"{r.preset}: {describe_config(r.config)}; {r.n_params:,} params",
        f"{r.dtype}, batch {r.batch_size} x {r.seq_len}, tolerance {r.tolerance:.0e} (relative, per leaf)"
        if not mixed else f"batch {r.batch_size} x {r.seq_len}; {criterion(r.dtype, r.tolerance, mixed)}",
        f"loss: manual {r.loss['manual']:.9e}   autodiff {r.loss['auto']:.9e}   "
        f"rel {_sci(r.loss['rel'])}{_mixed_loss(r.loss)}   {status(r.loss['passed'], color)}",
        rule,
    ]
    width = max([len(x["path"]) for x in r.leaves] + [4])
    lines.append(f"{'leaf':<{width}}  {'shape':<14} {'max abs err':>11}  {'rel err':>9}  "
                 f"{'cosine':>15}  " + (f"{'manual err':>10}  {'auto err':>9}  " if mixed else "")
                 + f"{'':4}")
    fd_rel = {x["path"]: x["rel"] for x in (r.fd or {}).get("leaves", [])}
    if r.fd:
        lines[-1] += f"  {'fd rel':>9}"
    for x in r.leaves:
        ref = (f"{_sci(x['manual_ref_rel']):>10}  {_sci(x['auto_ref_rel']):>9}  "
               if mixed else "")
        line = (f"{x['path']:<{width}}  {_shape(x['shape']):<14} {_sci(x['max_abs']):>11}  "
                f"{_sci(x['rel']):>9}  {x['cosine']:>15.12f}  {ref}{status(x['passed'], color)}")
        if r.fd and x["path"] in fd_rel:
            line += f"  {_sci(fd_rel[x['path']]):>9}"
        lines.append(line)
    lines.append(rule)
    bw = max([len(b["block"]) for b in r.blocks] + [5])
    lines.append(f"{'block':<{bw}}  {'leaves':>6}  {'worst rel':>9}  {'worst leaf':<{width}}")
    for b in r.blocks:
        lines.append(f"{b['block']:<{bw}}  {b['n_leaves']:>6}  {_sci(b['worst_rel']):>9}  "
                     f"{b['worst_leaf']:<{width}}  {status(b['passed'], color)}")
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
        worst = max(checks, key=lambda x: error_rank(x["rel"]))
        smaller = sum(x["eps"] < r.fd["eps"] for x in checks)
        lines += [rule, (
            f"finite differences (float64, eps {r.fd['eps']:g}, {plural(r.fd['n_directions'], 'direction')} "
            f"per leaf and over the whole tree): worst rel {_sci(worst['rel'])} at "
            f"{worst.get('path', 'whole tree')}, tolerance {r.fd['tolerance']:.0e}  "
            f"{status(r.fd['passed'], color)}")]
        if smaller:
            lines.append(f"  (step reduced, down to {min(x['eps'] for x in checks):g}, in {smaller} "
                         f"of the {len(checks)} directions shown, where the loss has a kink "
                         f"within eps)")
    worst = max(r.leaves, key=lambda x: error_rank(x["rel"]), default=None)
    summary = f"{r.preset}: {status(r.passed, color)}"
    if worst is not None and mixed:
        ratio = max((x["manual_ref_rel"] / max(x["auto_ref_rel"], mixed["floor"])
                     for x in r.leaves), key=error_rank)
        summary += (f"  ({len(r.leaves)} leaves, worst manual err / max(autodiff err, floor) "
                    f"{ratio:.2f}, allowed {mixed['factor']:g})")
    elif worst is not None:
        summary += (f"  ({len(r.leaves)} leaves, worst rel {_sci(worst['rel'])} at "
                    f"{worst['path']}, tolerance {r.tolerance:.0e})")
    lines += [rule, summary]
    lines += [f"  over tolerance: {f}" for f in r.failures]
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# report files


def build_report(reports: Sequence, options: dict) -> dict:
    device = jax.devices()[0]
    return dict(
        passed=all(r.passed for r in reports),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        options=options,
        environment=dict(jax=jax.__version__, backend=jax.default_backend(),
                         device=str(device), python=sys.version.split()[0]),
        presets=[r.to_dict() for r in reports],
    )


def _tolerance_cell(p: dict) -> str:
    mixed = p.get("mixed")
    if mixed:
        return f"{mixed['compute_dtype']}: {mixed['factor']:g} x autodiff's error"
    return f"{p['tolerance']:.0e}"


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
        worst = max(p["leaves"], key=lambda x: error_rank(x["rel"]), default=dict(rel=math.nan, path="-"))
        lines.append(f"| {p['preset']} | {p['dtype']} | {len(p['leaves'])} | {_sci(_num(worst['rel']))} "
                     f"| `{worst['path']}` | {_tolerance_cell(p)} | {p['timings']['ratio_step']:.2f} x "
                     f"| {yes(p['passed'])} |")
    for p in report["presets"]:
        t = p["timings"]
        lines += [
            "", f"## {p['preset']}: {yes(p['passed'])}", "",
            f"{describe_config(p['config'])}; {p['n_params']:,} params; "
            f"batch {p['batch_size']} x {p['seq_len']}; "
            f"{criterion(p['dtype'], p['tolerance'], p.get('mixed'))}.",
            "",
            f"Loss: manual {_num(p['loss']['manual']):.9e}, autodiff {_num(p['loss']['auto']):.9e}, "
            f"rel {_sci(_num(p['loss']['rel']))}{_mixed_loss(p['loss'])}.",
            "",
        ]
        if p["failures"]:
            lines += ["Over tolerance:", ""] + [f"- `{f}`" for f in p["failures"]] + [""]
        fd_rel = {x["path"]: x["rel"] for x in (p["fd"] or {}).get("leaves", [])}
        head = "| leaf | shape | max abs err | rel err | cosine | result |"
        sep = "|---|---|---:|---:|---:|---|"
        if p.get("mixed"):
            head = head.replace(" result |", " manual err vs ref | autodiff err vs ref | result |")
            sep += "---:|---:|"
        if p["fd"]:
            head, sep = head + " fd rel err |", sep + "---:|"
        lines += [head, sep]
        for x in p["leaves"]:
            ref = (f"{_sci(_num(x['manual_ref_rel']))} | {_sci(_num(x['auto_ref_rel']))} | "
                   if p.get("mixed") else "")
            row = (f"| `{x['path']}` | {_shape(x['shape'])} | {_sci(_num(x['max_abs']))} | "
                   f"{_sci(_num(x['rel']))} | {_num(x['cosine']):.12f} | {ref}{yes(x['passed'])} |")
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
                      f"{plural(fd['n_directions'], 'random unit direction')} per leaf, tolerance "
                      f"{fd['tolerance']:.0e}, floor {fd['floor']:.1e}): "
                      f"{yes(fd['passed'])}; over the whole tree: "
                      + ", ".join(_sci(_num(w["rel"])) for w in fd["whole_tree"]) + "."]
    lines += ["", "![relative error per leaf](rel_errors.png)", ""]
    return "\n".join(lines)


def _num(x) -> float:
    return float(x)  # also reads back "nan" / "inf" from json_safe


def write_reports(report: dict, out: str | os.PathLike) -> dict:
    """report.json, report.md and rel_errors.png in ``out`` (created); returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = dict(json=out / "report.json", markdown=out / "report.md", png=out / "rel_errors.png")
    safe = json_safe(report)  # non-finite floats as "nan" / "inf": the file stays strict JSON
    write_json(paths["json"], safe)
    paths["markdown"].write_text(format_markdown(safe))
    plot_report(safe, paths["png"])
    return paths


