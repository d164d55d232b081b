"""An observer of the manual forward and backward: a tap sees every stage's values.

A tap is any object with two methods:

    tap.forward(stage, x, y, p)      after a forward stage: its input x (None for token
                                     ids), its output y, its params p (None for a residual add)
    tap.backward(stage, dy, dp, dx)  after a backward stage: the gradient dy it received,
                                     its parameter gradients dp (None for a residual add)
                                     and the gradient dx it passes on (None at the embeddings)

``block_fwd`` / ``block_bwd`` (block.py), ``blocks_fwd`` / ``blocks_bwd`` (remat.py) and
``value_and_grad`` (model.py) take ``tap=None``. With None nothing is called, so the
traced program is the one without the hook. A tap inspects values eagerly: with one,
the blocks run as a Python loop over layers rather than a scan, and the stages of
layer l are named under "blocks[l].".
"""

from __future__ import annotations


def tap_forward(tap, stage: str, x, y, p=None) -> None:
    """tap.forward(stage, x, y, p), unless tap is None."""
    if tap is not None:
        tap.forward(stage, x, y, p)


def tap_backward(tap, stage: str, dy, dp=None, dx=None) -> None:
    """tap.backward(stage, dy, dp, dx), unless tap is None."""
    if tap is not None:
        tap.backward(stage, dy, dp, dx)


class Within:
    """A tap that passes every stage on to ``tap`` under ``prefix``: "ln1" -> "blocks[1].ln1"."""

    def __init__(self, tap, prefix: str):
        self.tap, self.prefix = tap, prefix

    def forward(self, stage, x, y, p=None):
        self.tap.forward(self.prefix + stage, x, y, p)

    def backward(self, stage, dy, dp=None, dx=None):
        self.tap.backward(self.prefix + stage, dy, dp, dx)


def within(tap, prefix: str):
    """``tap`` naming its stages under ``prefix``; None stays None."""
    return None if tap is None else Within(tap, prefix)
