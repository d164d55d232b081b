"""The run's own records: metrics.jsonl (read, repaired, truncated) and its plots."""

from __future__ import annotations

import json
import sys
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
# record keys about the run (speed, compile time, a resume marker), not the model's
# trajectory: a resumed run's records equal an uninterrupted run's without them
RUN_KEYS = frozenset({"tokens_per_s", "compile_s", "resumed"})
GRAD_PLOT_FILE = "grad_norms.png"
GRAD_NORM_PREFIX = "grad_norm/"  # per-layer gradient norms: grad_norm/embed, grad_norm/block0, ...


def write_record(path: Path, record: dict) -> None:
    """Append ``record`` to the metrics file ``path`` as one JSON line."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _parse_lines(path: Path) -> tuple[list[dict], bool]:
    """(records, whether a cut-off last line was dropped). A run killed while writing
    leaves its last line incomplete; a bad line anywhere else is a ValueError naming it."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records, cut = [], False
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:
                cut = True
                break
            raise ValueError(f"{path} line {i + 1} is not a JSON record: {line[:60]!r}") from None
    return records, cut


def read_metrics(run_dir) -> list[dict]:
    """The records of ``<run_dir>/metrics.jsonl`` (a cut-off last line is left out)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    return _parse_lines(path)[0]


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines logged after ``last_step`` (written after the checkpoint a run resumes),
    and repair a last line cut off by a kill (dropped, with a note on stderr)."""
    if not path.exists():
        return
    records, cut = _parse_lines(path)
    if cut:
        print(f"warning: {path}: dropped its last line, cut off by an interrupted write",
              file=sys.stderr)
    kept = [r for r in records if r.get("step", 0) <= last_step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def plot_losses(records: list[dict], path) -> None:
    """A PNG of the training loss (and validation loss where evaluated) against step, the
    learning rate on a secondary axis and a dotted line where a run was resumed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", ms=4)
    for i, step in enumerate(r["step"] for r in records if r.get("resumed")):
        ax.axvline(step, color="gray", ls=":", lw=1, label="resumed" if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats / token)")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    lr = [(r["step"], r["lr"]) for r in records if r.get("lr") is not None]
    if lr:
        ax_lr = ax.twinx()  # the learning rate on a secondary axis
        line, = ax_lr.plot(*zip(*lr), color="tab:green", lw=1, alpha=0.7, label="learning rate")
        ax_lr.set_ylabel("learning rate")
        ax_lr.set_ylim(bottom=0)
        handles.append(line)
        labels.append(line.get_label())
    ax.legend(handles, labels)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_grad_norms(records: list[dict], path) -> None:
    """A PNG of each layer's gradient norm against step (log scale), from the
    ``grad_norm/<layer>`` fields of the records; nothing when there are none."""
    names = sorted({k for r in records for k in r if k.startswith(GRAD_NORM_PREFIX)},
                   key=_layer_order)
    if not names:
        return
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name in names:
        points = [(r["step"], r[name]) for r in records if r.get(name) is not None and r[name] > 0]
        if points:
            ax.plot(*zip(*points), label=name[len(GRAD_NORM_PREFIX):], lw=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm")
    ax.set_title("gradient norm per layer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _layer_order(name: str):
    layer = name[len(GRAD_NORM_PREFIX):]
    if layer.startswith("block"):
        return (1, int(layer[len("block"):]))
    return (0 if layer == "embed" else 2, 0)
