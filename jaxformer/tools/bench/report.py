"""The benchmark's reports: report.json, report.md and bench.png (see tools/bench/run.py)."""

from __future__ import annotations

import os
from pathlib import Path

from jaxformer.observe.jsonsafe import json_safe, write_json

LABELS = {"manual_full": "JAX manual, full", "manual_blockwise": "JAX manual, blockwise",
          "manual_pallas": "JAX manual, pallas", "manual_cudnn": "JAX manual, cudnn",
          "auto_full": "JAX jax.grad, full",
          "auto_cudnn": "JAX jax.grad, cudnn", "torch_eager": "PyTorch eager, SDPA",
          "torch_compile": "PyTorch torch.compile, SDPA"}
RATIO_LABELS = {
    "manual_over_auto_step_time": "manual / jax.grad step time (full attention)",
    "manual_over_torch_eager_tokens_per_s": "manual (full) tok/s / PyTorch eager tok/s",
    "manual_over_torch_compile_tokens_per_s": "manual (full) tok/s / torch.compile tok/s",
}


def _mib(n):
    return "-" if n is None else f"{n / 2**20:.1f}"


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def moe_shape(c: dict) -> str:
    """" E8 k2 Fe512 Fs256" for a mixture of experts (experts, per token, widths), else ""."""
    if not c.get("n_experts"):
        return ""
    shared = f" Fs{c['shared_expert_d_ff']}" if c.get("shared_expert_d_ff") else ""
    return f" E{c['n_experts']} k{c['experts_per_token']} Fe{c.get('expert_d_ff') or c['d_ff']}{shared}"


def shape_line(report: dict) -> str:
    c, sh = report["shape"]["config"], report["shape"]
    return (f"L{c['n_layers']} D{c['d_model']} H{c['n_heads']} F{c['d_ff']}{moe_shape(c)} "
            f"B{sh['batch_size']} T{sh['seq_len']} V{c['vocab_size']} ({c['norm']}-LN, {c['activation']}, "
            f"{c['positions']} positions, compute {c.get('compute_dtype') or 'float32'}, "
            f"{sh['params']:,} params)")


def contestant_rows(report: dict) -> list[list[str]]:
    rows = []
    for name, r in report["contestants"].items():
        if r.get("status") == "skipped" or r.get("error"):
            rows.append([LABELS.get(name, name), "skipped: " + (r.get("reason") or r.get("error") or ""),
                         "", "", "", "", ""])
            continue
        tok, ms = r["tokens_per_s"], r["ms_per_step"]
        mfu = None if r.get("mfu") is None else 100 * r["mfu"]
        rows.append([LABELS.get(name, name),
                     f"{tok['median']:,.0f} ({tok['min']:,.0f}-{tok['max']:,.0f})",
                     f"{ms['median']:.2f}", f"{r['model_flops_per_s'] / 1e9:.2f}",
                     _fmt(mfu, ".2f"), _fmt(r.get("compile_s"), ".2f"),
                     _mib((r.get("memory") or {}).get("temp_bytes"))])
    return rows


def format_markdown(report: dict) -> str:
    m, f, p = report["machine"], report["flops"], report["peak"]
    lines = [f"# Training-step benchmark: {shape_line(report)}", "",
             f"{report['time_utc']}, {m['platform']} ({m['device_kind']}), {m['cpu_count']} CPU cores, "
             f"jax {m['jax']}, torch {m.get('torch') or 'not installed'}"
             + (f" ({m['torch_threads']} threads)" if m.get("torch_threads") else "")
             + f"; load average {m['loadavg_before'][0]:.2f} before, {m['loadavg_after'][0]:.2f} after.",
             "", f"Command: `{report['command']}`", "",
             f"{report['settings']['rounds']} interleaved rounds of {report['settings']['steps_per_round']} "
             f"steps after {report['settings']['warmup_steps']} warm-up steps; AdamW "
             f"(lr {report['settings']['optimizer']['lr']}, weight decay "
             f"{report['settings']['optimizer']['weight_decay']}) in every framework.", "",
             "| contestant | tokens/s median (min-max) | ms/step | model GFLOP/s | MFU % | compile s "
             "| XLA temp MiB (step) |", "|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in contestant_rows(report)]
    if report.get("fastest"):
        lines += ["", f"Fastest: {LABELS.get(report['fastest'], report['fastest'])}."]
    lines += ["", "Ratios: per round (the contestants ran side by side), median over rounds (min-max).", "",
              "| ratio | median (min-max) | target |", "|---|---|---|"]
    for key, value in report["ratios"].items():
        t = report["targets"].get(key)
        target = f"{t['bound']} ({'met' if t['met'] else 'not met'})" if t else ""
        lines.append(f"| {RATIO_LABELS.get(key, key)} | {value['median']:.2f} "
                     f"({value['min']:.2f}-{value['max']:.2f}) | {target} |")
    if report["grad_fns"]:
        lines += grad_fn_lines(report["grad_fns"])
    peak = "unknown" if p["flops_per_s"] is None else f"{p['flops_per_s'] / 1e9:,.1f} GFLOP/s"
    lines += ["", f"Model FLOPs per token: {f['per_token']:,} ({f['convention']}); "
              f"6N = {f['dense_6N']:,}, attention = {f['attention']:,}."
              + (f" Mixture of experts: N counts the active parameters ({f['matmul_params']:,} of the "
                 f"{f['matmul_params_all_experts']:,} matmul params of all experts), so MFU is the "
                 "active-parameter MFU." if "matmul_params_all_experts" in f else ""),
              f"Peak ({p['dtype']}): {peak} ({p['source']}).", ""]
    lines += [f"Note: {n}." for n in report["notes"]]
    return "\n".join(lines).rstrip() + "\n"


def grad_fn_lines(grad_fns: dict) -> list[str]:
    """The table of the full-attention gradient functions: compile time by depth, memory."""
    depths = next(iter(grad_fns.values()))["compile_s_by_depth"]
    lines = ["", "JAX gradient functions, full attention (XLA `memory_analysis`, compile = trace + "
             "lower + compile):", "",
             "| gradients | compile s | " + " | ".join(f"compile s at L={L}" for L in depths)
             + " | temp MiB | argument MiB | output MiB |", "|---|---|---|---|---|---|---|"]
    for name, g in grad_fns.items():
        mem = g["memory"] or {}
        depth = " | ".join(f"{v:.2f}" for v in g["compile_s_by_depth"].values())
        lines.append(f"| {name} | {g['compile_s']:.2f} | {depth} | {_mib(mem.get('temp_bytes'))} | "
                     f"{_mib(mem.get('argument_bytes'))} | {_mib(mem.get('output_bytes'))} |")
    return lines


def format_summary(report: dict) -> str:
    """A plain-text table for the terminal."""
    out = [shape_line(report),
           f"{'contestant':<30}{'tokens/s (min-max)':>30}{'ms/step':>10}{'MFU %':>8}{'compile s':>11}"
           f"{'XLA temp MiB':>14}"]
    for row in contestant_rows(report):
        if row[1].startswith("skipped"):
            out.append(f"{row[0]:<30}{row[1]}")
        else:
            out.append(f"{row[0]:<30}{row[1]:>30}{row[2]:>10}{row[4]:>8}{row[5]:>11}{row[6]:>14}")
    for key, value in report["ratios"].items():
        out.append(f"{RATIO_LABELS.get(key, key)}: {value['median']:.2f} per-round median "
                   f"({value['min']:.2f}-{value['max']:.2f})")
    m = report["machine"]
    out.append(f"load average {m['loadavg_before'][0]:.2f} -> {m['loadavg_after'][0]:.2f} "
               f"on {m['cpu_count']} cores")
    return "\n".join(out)


def plot(report: dict, path) -> None:
    """Tokens/s per contestant (median bar, min-max whisker) and compile time vs depth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {k: r for k, r in report["contestants"].items() if r.get("tokens_per_s")}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    names = list(ok)
    med = [ok[n]["tokens_per_s"]["median"] for n in names]
    err = [[m - ok[n]["tokens_per_s"]["min"] for n, m in zip(names, med)],
           [ok[n]["tokens_per_s"]["max"] - m for n, m in zip(names, med)]]
    ax1.bar(range(len(names)), med, yerr=err, capsize=4, color=[f"C{i}" for i in range(len(names))])
    ax1.set_xticks(range(len(names)), [LABELS.get(n, n).replace(", ", "\n") for n in names], fontsize=7)
    ax1.set_ylabel("tokens/s (median, min-max)")
    ax1.set_title(shape_line(report).split(" (")[0], fontsize=9, loc="left")
    for name, g in report["grad_fns"].items():
        depths = list(g["compile_s_by_depth"])
        ax2.plot([int(d) for d in depths], list(g["compile_s_by_depth"].values()), "o-",
                 label=LABELS.get(f"{name}_full", name))
    ax2.set_xlabel("n_layers")
    ax2.set_ylabel("gradient compile time (s)")
    ax2.set_ylim(bottom=0)
    if report["grad_fns"]:
        ax2.legend(fontsize=8)
    else:
        ax2.text(0.5, 0.5, "depth check not run", ha="center", transform=ax2.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_files(report: dict, out: str | os.PathLike, markdown, png, png_name: str) -> dict:
    """report.json, report.md (``markdown(report)``) and the plot (``png(report, path)``,
    named ``png_name``) in ``out`` (created); returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    safe = json_safe(report, non_finite="null")  # a missing number: "-" in the tables
    paths = {"json": out / "report.json", "markdown": out / "report.md", "png": out / png_name}
    write_json(paths["json"], safe)
    paths["markdown"].write_text(markdown(safe))
    png(safe, paths["png"])
    return paths


def write_reports(report: dict, out: str | os.PathLike) -> dict:
    """report.json, report.md and bench.png in ``out`` (created); returns their paths."""
    return write_files(report, out, format_markdown, plot, "bench.png")
