"""The outcomes of aot.py (``aot.Outcome``) in words: one line each, and a markdown table."""

from __future__ import annotations

GiB = 2**30


def describe(o) -> str:
    """One line: variant, target, stage, seconds, kernels, memory or reason."""
    head = f"{o.variant.name} {o.target} B={o.batch_size}: {o.stage} in {o.seconds:.1f}s"
    if o.memory:
        m = o.memory
        launched = f", {o.launches:,} launches per step" if o.launches else ""
        return (f"{head}, {o.kernels} kernels{launched}, temp {m.temp / GiB:.2f} GiB, argument "
                f"{m.argument / GiB:.2f} GiB, total {m.total / GiB:.2f} GiB")
    return f"{head}: {o.reason}" if o.reason else f"{head}, {o.kernels} kernels"


def table(outcomes) -> str:
    """A markdown table of outcomes: variant, target, stage, seconds, kernels, memory (GiB)."""
    gib = lambda b: f"{b / GiB:.2f}"  # noqa: E731
    rows = ["| variant | target | B | stage | s | kernels | temp | argument | output | alias | code | total |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        m = o.memory
        memory = [gib(m.temp), gib(m.argument), gib(m.output), gib(m.alias), gib(m.code), gib(m.total)] \
            if m else [o.reason or ""] + [""] * 5
        rows.append("| " + " | ".join([o.variant.name, o.target, str(o.batch_size), o.stage,
                                       f"{o.seconds:.1f}", str(o.kernels) if o.stage != "skipped" else "",
                                       *memory]) + " |")
    return "\n".join(rows)
