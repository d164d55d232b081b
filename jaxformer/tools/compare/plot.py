"""The gradient comparison's figure, rel_errors.png: the relative error of each leaf on a
log axis, one panel per preset, one color per source (reads ``compare_report.build_report``'s
dict, JSON-safe: "nan" / "inf" strings read back with float)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

SOURCE_AUTO = "manual vs autodiff"
SOURCE_FD = "finite differences vs manual (float64)"
SOURCE_MANUAL_REF = "manual vs float32 reference"
SOURCE_AUTO_REF = "autodiff vs float32 reference"


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
        series = [(SOURCE_AUTO, [float(x["rel"]) for x in p["leaves"]], "o", "tab:blue",
                   p["tolerance"], f"tolerance {p['dtype']}", "--")]
        if p.get("mixed"):
            series = [(SOURCE_AUTO, [float(x["rel"]) for x in p["leaves"]], "o", "tab:blue",
                       None, "", ""),
                      (SOURCE_MANUAL_REF, [float(x["manual_ref_rel"]) for x in p["leaves"]], "s",
                       "tab:green", None, "", ""),
                      (SOURCE_AUTO_REF, [float(x["auto_ref_rel"]) for x in p["leaves"]], "D",
                       "tab:purple", p["mixed"]["floor"], "floor", ":")]
        if p["fd"]:
            series.append((SOURCE_FD, [float(fd_rel.get(q, math.nan)) for q in paths], "^",
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
            if tol is not None:
                ax.axhline(tol, color=color, ls=ls, lw=1, label=f"{tol_label} ({tol:.0e})")
        ax.set_yscale("log")
        ax.set_xticks(xs, paths, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("relative error")
        products = f", products in {p['mixed']['compute_dtype']}" if p.get("mixed") else ""
        ax.set_title(f"{p['preset']} ({p['dtype']}{products}): {'PASS' if p['passed'] else 'FAIL'}",
                     loc="left", fontsize=10)
        ax.grid(True, axis="y", which="major", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=110)
