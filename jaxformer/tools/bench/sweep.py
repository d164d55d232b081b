"""The benchmark over a grid of shapes: one short ``bench.run`` per shape, one row each.

    jaxformer bench --shapes "d_model=64,128,256,512,768 seq_len=64,256,1024"

The grid is written as space-separated ``field=v1,v2,...`` axes; every combination
is a shape (the first axis varies slowest). Fields: n_layers, d_model, n_heads,
d_ff, seq_len, batch_size. Sweeping d_model without d_ff keeps d_ff = 4 * d_model
(GPT's ratio); max_seq_len grows to the longest seq_len. Each shape runs the same
contestants with the same --rounds / --steps, and skips the compile-vs-depth check.
``run_sweep`` returns the sweep's report dict (bench_sweep_report writes it).
"""

from __future__ import annotations

import itertools
import shlex
import sys
import time
from collections.abc import Callable

from jaxformer.tools.bench import run as bench

SWEEP_FIELDS = ("n_layers", "d_model", "n_heads", "d_ff", "seq_len", "batch_size")
SHORT = {"n_layers": "L", "d_model": "D", "n_heads": "H", "d_ff": "F", "seq_len": "T", "batch_size": "B"}


def parse_shapes(text: str) -> dict[str, tuple[int, ...]]:
    """``"d_model=64,128 seq_len=64,256"`` -> {"d_model": (64, 128), "seq_len": (64, 256)};
    ValueError naming the axis that is malformed, unknown, repeated or not positive."""
    axes: dict[str, tuple[int, ...]] = {}
    for part in text.split():
        field, sep, values = part.partition("=")
        field = field.strip().replace("-", "_")
        if not sep or not values:
            raise ValueError(f"--shapes: expected field=v1,v2,... separated by spaces, got {part!r}")
        if field not in SWEEP_FIELDS:
            raise ValueError(f"--shapes: unknown field {field!r}; choose from {', '.join(SWEEP_FIELDS)}")
        if field in axes:
            raise ValueError(f"--shapes: {field} given twice")
        try:
            numbers = tuple(int(v) for v in values.split(","))
        except ValueError:
            raise ValueError(f"--shapes: {field} takes comma-separated integers, got {values!r}") from None
        if min(numbers) < 1:
            raise ValueError(f"--shapes: {field} values must be positive, got {values!r}")
        axes[field] = numbers
    if not axes:
        raise ValueError(f"--shapes: expected at least one field=v1,v2,... axis, got {text!r}")
    return axes


def grid(axes: dict[str, tuple[int, ...]]) -> list[dict[str, int]]:
    """Every combination of the axes' values, the first axis varying slowest."""
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def point_label(point: dict[str, int]) -> str:
    """{"d_model": 64, "seq_len": 256} -> "D64 T256"."""
    return " ".join(f"{SHORT[k]}{v}" for k, v in point.items())


def point_settings(base: bench.Settings, point: dict[str, int]) -> bench.Settings:
    """The Settings of one shape: ``base`` with the point's fields (d_ff = 4 * d_model
    when d_model is set and d_ff is not; max_seq_len at least seq_len), no depth check.
    ValueError (ModelConfig's, naming the field) prefixed by the shape on a bad one."""
    model = {k: v for k, v in point.items() if k in ("n_layers", "d_model", "n_heads", "d_ff")}
    if "d_model" in model and "d_ff" not in model:
        model["d_ff"] = 4 * model["d_model"]
    seq_len = point.get("seq_len", base.seq_len)
    model["max_seq_len"] = max(base.config.max_seq_len, seq_len)
    try:
        config = base.config.replace(**model)
    except ValueError as e:
        raise ValueError(f"--shapes: shape {point_label(point)}: {e}") from None
    return base._replace(config=config, seq_len=seq_len, batch_size=point.get("batch_size", base.batch_size),
                         depths=None)


def sweep_row(point: dict, report: dict) -> dict:
    """One row of the sweep table: the shape and each contestant's median tokens/s (None
    when it was skipped, with the reason)."""
    row = {"point": point, "label": point_label(point), "fastest": report["fastest"],
           "batch_size": report["shape"]["batch_size"], "seq_len": report["shape"]["seq_len"],
           "tokens_per_s": {}, "mfu": {}, "skipped": {}}
    for name, r in report["contestants"].items():
        if r.get("tokens_per_s"):
            row["tokens_per_s"][name] = r["tokens_per_s"]["median"]
            row["mfu"][name] = r.get("mfu")
        else:
            row["skipped"][name] = r.get("reason")
    return row


def run_sweep(base: bench.Settings, axes: dict[str, tuple[int, ...]],
              say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> dict:
    """Run the benchmark at every shape of ``axes``; returns the sweep report dict. Every
    shape is checked before the first one runs."""
    points = grid(axes)
    settings = [point_settings(base, p) for p in points]
    rows, reports = [], []
    quiet = set()  # skip lines already said at an earlier shape

    def say_once(line):
        if line not in quiet:
            quiet.add(line)
            say(line)

    for i, (point, s) in enumerate(zip(points, settings)):
        say(f"[{i + 1}/{len(points)}] {point_label(point)} (L{s.config.n_layers} D{s.config.d_model} "
            f"H{s.config.n_heads} F{s.config.d_ff} B{s.batch_size} T{s.seq_len})")
        report = bench.run(s, say=say_once)
        reports.append(report)
        rows.append(sweep_row(point, report))
    first = reports[0]
    return {
        "command": shlex.join(sys.argv),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {**first["machine"], "loadavg_after": reports[-1]["machine"]["loadavg_after"]},
        "settings": first["settings"],
        "base_config": base.config.to_dict(),
        "axes": {k: list(v) for k, v in axes.items()},
        "contestants": list(first["contestants"]),
        "rows": rows,
        "reports": reports,
    }
