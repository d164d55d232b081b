"""The shape sweep's reports: report.json, report.md (one row per shape, each
contestant's tokens/s, the fastest in bold) and bench_sweep.png (tokens/s and the
ratio to the fastest, per shape, one line per contestant); see tools/bench/sweep.py."""

from __future__ import annotations

import os

from jaxformer.observe.words import plural
from jaxformer.tools.bench.report import LABELS, write_files


def ran_contestants(sweep: dict) -> list[str]:
    """The contestants that ran at one shape at least, in the benchmark's order."""
    return [n for n in sweep["contestants"] if any(n in row["tokens_per_s"] for row in sweep["rows"])]


def format_sweep_markdown(sweep: dict) -> str:
    m, s = sweep["machine"], sweep["settings"]
    names = ran_contestants(sweep)
    axes = " ".join(f"{k}={','.join(str(v) for v in vs)}" for k, vs in sweep["axes"].items())
    c = sweep["base_config"]
    lines = [f"# Training-step benchmark over shapes: {axes}", "",
             f"{sweep['time_utc']}, {m['platform']} ({m['device_kind']}), {m['cpu_count']} CPU cores, "
             f"jax {m['jax']}, torch {m.get('torch') or 'not installed'}; load average "
             f"{m['loadavg_before'][0]:.2f} before, {m['loadavg_after'][0]:.2f} after.", "",
             f"Command: `{sweep['command']}`", "",
             f"Base model L{c['n_layers']} D{c['d_model']} H{c['n_heads']} F{c['d_ff']} V{c['vocab_size']}, "
             f"compute {c.get('compute_dtype') or 'float32'}; each shape: {s['rounds']} interleaved rounds "
             f"of {plural(s['steps_per_round'], 'step')} after {plural(s['warmup_steps'], 'warm-up step')}. Tokens/s, median "
             f"over rounds; the fastest per shape in bold.", "",
             "| shape | B | T | " + " | ".join(LABELS.get(n, n) for n in names) + " | fastest |",
             "|---|---:|---:|" + "---:|" * len(names) + "---|"]
    for row in sweep["rows"]:
        cells = []
        for n in names:
            tok = row["tokens_per_s"].get(n)
            text = "skipped" if tok is None else f"{tok:,.0f}"
            cells.append(f"**{text}**" if n == row["fastest"] else text)
        fastest = LABELS.get(row["fastest"], row["fastest"]) if row["fastest"] else "-"
        lines.append(f"| {row['label']} | {row['batch_size']} | {row['seq_len']} | "
                     + " | ".join(cells) + f" | {fastest} |")
    skipped = {}
    for row in sweep["rows"]:
        for n, reason in row["skipped"].items():
            skipped.setdefault(n, reason)
    lines += [""] + [f"Skipped: {LABELS.get(n, n)}: {reason}." for n, reason in skipped.items()]
    lines += ["", "Plot: bench_sweep.png (tokens/s per shape; each contestant's tokens/s over the "
              "fastest's at that shape). Per-shape reports: report.json, `reports`."]
    return "\n".join(lines).rstrip() + "\n"


def format_sweep_summary(sweep: dict) -> str:
    """A plain-text table for the terminal: tokens/s per shape and contestant."""
    names = ran_contestants(sweep)
    width = max([len(r["label"]) for r in sweep["rows"]] + [5]) + 2
    out = [f"{'shape':<{width}}" + "".join(f"{n:>18}" for n in names) + "  fastest"]
    for row in sweep["rows"]:
        cells = "".join(f"{row['tokens_per_s'].get(n, float('nan')):>18,.0f}" for n in names)
        out.append(f"{row['label']:<{width}}{cells}  {row['fastest'] or '-'}")
    return "\n".join(out)


def plot_sweep(sweep: dict, path) -> None:
    """Two panels over the shapes: tokens/s (log scale), and tokens/s over the fastest
    contestant's at each shape (1 = that shape's winner); one line per contestant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sweep["rows"]
    x = list(range(len(rows)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, name in enumerate(ran_contestants(sweep)):
        tok = [r["tokens_per_s"].get(name) for r in rows]
        best = [max(r["tokens_per_s"].values()) if r["tokens_per_s"] else None for r in rows]
        rel = [t / b if t is not None and b else None for t, b in zip(tok, best)]
        kw = dict(marker="o", color=f"C{i}", label=LABELS.get(name, name))
        ax1.plot(x, [float("nan") if t is None else t for t in tok], **kw)
        ax2.plot(x, [float("nan") if r is None else r for r in rel], **kw)
    labels = [r["label"] for r in rows]
    for ax in (ax1, ax2):
        ax.set_xticks(x, labels, rotation=45, ha="right", fontsize=7)
        ax.set_xlabel("shape")
        ax.grid(alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("tokens/s (median over rounds)")
    ax2.set_ylabel("tokens/s / fastest at that shape")
    ax2.set_ylim(0, 1.05)
    ax1.legend(fontsize=7)
    m = sweep["machine"]
    fig.suptitle(f"training step by shape, {m['platform']} ({m['device_kind']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_sweep_reports(sweep: dict, out: str | os.PathLike) -> dict:
    """report.json, report.md and bench_sweep.png in ``out`` (created); returns their paths."""
    return write_files(sweep, out, format_sweep_markdown, plot_sweep, "bench_sweep.png")
