"""The record of a layer-by-layer diagnosis: value ranges, stages and the table.

``Recorder`` is a tap (manual_grads/tap.py): the manual forward and backward call
``forward(stage, x, y, p)`` and ``backward(stage, dy, dp, dx)`` after every stage, and
it keeps each stage's input and output range, its parameter gradient's norm and the
first non-finite value. ``Diagnosis`` holds the result and prints it as a table.
jaxformer/training/diagnose.py runs the computation.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Range:
    """The value range of an array; NaNs and infinities are counted, not ranged."""

    min: float
    max: float
    absmax: float
    n_nan: int
    n_inf: int

    @property
    def finite(self) -> bool:
        return self.n_nan == 0 and self.n_inf == 0

    def __str__(self) -> str:
        text = f"min {self.min:.4g}, max {self.max:.4g}, abs max {self.absmax:.4g}"
        if not self.finite:
            text += f" ({self.n_nan} NaN, {self.n_inf} inf)"
        return text


def value_range(x) -> Range:
    a = np.asarray(x, dtype=np.float64)
    ok = a[np.isfinite(a)]
    lo, hi = (float(ok.min()), float(ok.max())) if ok.size else (math.nan, math.nan)
    return Range(lo, hi, max(abs(lo), abs(hi)) if ok.size else math.nan,
                 int(np.isnan(a).sum()), int(np.isinf(a).sum()))


def tree_norm(tree) -> float:
    """The 2-norm of every leaf of ``tree`` together, in float64."""
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(g, np.float64))))
                         for g in jax.tree_util.tree_leaves(tree)))


@dataclasses.dataclass
class Stage:
    name: str  # e.g. "blocks[1].attn"
    inp: Range | None  # the forward input's range (None for token ids)
    out: Range  # the forward output's range
    grad_norm: float | None = None  # norm of this stage's parameter gradient (None: no params)


@dataclasses.dataclass
class Diagnosis:
    stages: list[Stage]  # forward order
    loss: float
    first: str | None  # the first non-finite value, e.g. "backward: blocks[0].ln1 dscale ..."
    settings: str = ""  # what ran, e.g. "blockwise attention (block 128), products in bfloat16, ..."

    def summary(self) -> str:
        if self.first is None:
            return ("every activation and gradient of the manual forward and backward of this "
                    "batch is finite")
        return f"first non-finite value: {self.first}"

    def table(self) -> str:
        head = f"{'stage':<26} {'in |max|':>10} {'out min':>10} {'out max':>10} {'out |max|':>10} {'grad norm':>10}"
        lines = [f"settings: {self.settings}", head, "-" * len(head)]
        for s in self.stages:
            grad = "-" if s.grad_norm is None else f"{s.grad_norm:.4g}"
            inp = "-" if s.inp is None else f"{s.inp.absmax:.4g}"
            bad = "" if s.out.finite else f"  <- {s.out.n_nan} NaN, {s.out.n_inf} inf"
            lines.append(f"{s.name:<26} {inp:>10} {s.out.min:>10.4g} {s.out.max:>10.4g} "
                         f"{s.out.absmax:>10.4g} {grad:>10}{bad}")
        lines.append(f"loss {self.loss:.6g}; {self.summary()}")
        return "\n".join(lines)


def non_finite_leaf(params) -> str | None:
    """The path of the first leaf of ``params`` holding a NaN or an infinity, e.g. "['wq']"."""
    if params is None:
        return None
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not np.all(np.isfinite(np.asarray(leaf))):
            return jax.tree_util.keystr(path)
    return None


class Recorder:
    """A tap that records every stage (forward order) and the first non-finite value."""

    def __init__(self):
        self.stages: dict[str, Stage] = {}
        self.first: str | None = None

    def forward(self, name, x, y, p=None):
        inp = None if x is None else value_range(x)
        out = value_range(y)
        self.stages[name] = Stage(name, inp, out)
        if self.first is None and not out.finite:
            bad = non_finite_leaf(p)
            where = f"; its params{bad} hold non-finite values" if bad else ""
            self.first = (f"forward: {name} output is non-finite; its input has {inp}{where}"
                          if inp is not None else f"forward: {name} output is non-finite{where}")

    def backward(self, name, dy, dp=None, dx=None):
        named = [(f"d{jax.tree_util.keystr(p)[2:-2]}", g)
                 for p, g in jax.tree_util.tree_flatten_with_path(dp or {})[0]]
        if dx is not None:
            named.append(("dlogits" if name == "loss" else "dx", dx))
        if dp and name in self.stages:
            self.stages[name].grad_norm = tree_norm(dp)
        if self.first is not None:
            return
        for label, g in named:
            if not value_range(g).finite:
                self.first = f"backward: {name} {label} is non-finite; its input gradient has {value_range(dy)}"
                return

    def diagnosis(self, loss: float, settings: str = "") -> Diagnosis:
        return Diagnosis(list(self.stages.values()), loss, self.first, settings)
