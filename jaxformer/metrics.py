"""The run's own records: metrics.jsonl, the loss plot and the progress bar."""

from __future__ import annotations

import json
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
# record keys about the run (speed, compile time, a resume marker), not the model's
# trajectory: a resumed run's records equal an uninterrupted run's without them
RUN_KEYS = frozenset({"tokens_per_s", "compile_s", "resumed"})


def _write_record(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_metrics(run_dir) -> list[dict]:
    """The records of ``<run_dir>/metrics.jsonl``."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines logged after ``last_step`` (written after the checkpoint a run resumes)."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


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


def _progress_bar(start: int, total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, disable=not enabled, unit="step", dynamic_ncols=True)
