"""Conversations packed into rows, epochs counted in rows, and a second dataset mixed in.

Shape letters as elsewhere: B batch, T sequence length, R rows of a packing.

``pack(ids, mask, docs, seq_len)`` cuts a chat data folder's split into its conversations (a
conversation starts at each document start the shards carry; ``prepare`` opens each one with
the end-of-text id) and packs them whole into rows of T + 1 tokens, best fit, longest first:
each row holds whole conversations one after another, then padding (id 0, mask 0, a segment of
its own). A conversation longer than T + 1 tokens is cut to its first T + 1 (``Packing.cut``
counts them). The packing is a pure function of the split and T, so a resumed run packs alike.

A ``RowBatcher`` serves batches of rows

    {"inputs", "targets", "mask", "segments"}: int32 (B, T)

(``segments``: each input's conversation within its row, 0, 1, ...), as a pure function of
``(seed, index)``: the rows of every epoch in an order drawn from ``default_rng([seed, epoch])``,
one epoch after another, batch k being rows k B .. (k + 1) B - 1 of that sequence. So N epochs
are ceil(N R / B) steps and each conversation is seen N times (the last batch may reach into
the next epoch's first rows).

``MixedBatcher(main, other, weight, seed)`` puts rows of ``other`` (a second dataset: chats or
plain text) in a fraction ``weight`` of each batch's rows: batch k holds
floor((k + 1) B w) - floor(k B w) of them (the fraction is exact over the run, never more
than one row off in any batch), at rows drawn from ``default_rng([seed, MIX_STREAM, k])``; the
others are the main data's next rows. Both counts before batch k are closed forms, so a
batch is still a pure function of (seed, k) and a run resumes at any step.
"""

from __future__ import annotations

import bisect
import math
from typing import NamedTuple

import numpy as np

from jaxformer.data.batching import _windows
from jaxformer.model.checks import check_int, check_number

MIX_STREAM = 7  # the random stream that places the mixed-in rows (apart from the epochs' orders)


class Packing(NamedTuple):
    tokens: np.ndarray  # (R, T + 1) int32: each row's conversations, then padding (id 0)
    mask: np.ndarray  # (R, T + 1) int32: the loss mask of each token (0 on padding)
    segments: np.ndarray  # (R, T + 1) int32: each token's conversation within its row (padding: its own)
    conversations: int  # whole conversations packed
    cut: int  # conversations longer than T + 1 tokens, cut to their first T + 1
    longest: int  # the longest conversation's tokens (before any cut)


def conversation_spans(docs: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the conversations of a split of ``n`` tokens whose first tokens are
    marked 1 in ``docs``; the split's first token starts one (the split may begin inside one)."""
    starts = np.flatnonzero(np.asarray(docs))
    if not len(starts) or starts[0] != 0:
        starts = np.concatenate([[0], starts])
    starts = starts.astype(np.int64)
    lengths = np.diff(np.concatenate([starts, [n]]))
    return starts, lengths


def pack(ids, mask, docs, seq_len: int) -> Packing:
    """The conversations of a split (``ids`` (N,), ``mask`` (N,) or None for all 1, ``docs`` (N,))
    packed whole into rows of seq_len + 1 tokens: best fit, longest first."""
    seq_len = check_int("seq_len", seq_len)
    ids = np.asarray(ids)
    mask = np.ones(len(ids), np.int32) if mask is None else np.asarray(mask)
    width = seq_len + 1
    starts, lengths = conversation_spans(docs, len(ids))
    if not len(ids):
        raise ValueError("no conversations to pack: the split is empty")
    kept = np.minimum(lengths, width)
    order = np.argsort(-kept, kind="stable")  # longest first; ties in data order
    rows_of: list[list[int]] = []
    by_room: list[tuple[int, int]] = []  # (free tokens, row), sorted: best fit by bisection
    for c in order:
        need = int(kept[c])
        at = bisect.bisect_left(by_room, (need, -1))
        if at < len(by_room):
            free, row = by_room.pop(at)
        else:
            free, row = width, len(rows_of)
            rows_of.append([])
        rows_of[row].append(int(c))
        free -= need
        if free > 0:
            bisect.insort(by_room, (free, row))
    R = len(rows_of)
    tokens = np.zeros((R, width), np.int32)
    loss = np.zeros((R, width), np.int32)
    segments = np.zeros((R, width), np.int32)
    for r, members in enumerate(rows_of):
        at = 0
        for k, c in enumerate(sorted(members)):  # a row's conversations in data order
            s, n = int(starts[c]), int(kept[c])
            tokens[r, at:at + n] = ids[s:s + n]
            loss[r, at:at + n] = mask[s:s + n]
            segments[r, at:at + n] = k
            at += n
        segments[r, at:] = len(members)  # padding: a segment of its own
    return Packing(tokens, loss, segments, int(len(lengths)), int((lengths > width).sum()),
                   int(lengths.max()))


def rows_batch(packing: Packing, rows: np.ndarray) -> dict:
    """The batch of the packing's ``rows`` (indices): inputs, targets, mask, segments (B, T)."""
    t, m, s = packing.tokens[rows], packing.mask[rows], packing.segments[rows]
    return {"inputs": np.ascontiguousarray(t[:, :-1]), "targets": np.ascontiguousarray(t[:, 1:]),
            "mask": np.ascontiguousarray(m[:, 1:]), "segments": np.ascontiguousarray(s[:, :-1])}


def row_order(n_rows: int, seed: int, positions: np.ndarray) -> np.ndarray:
    """The row at each position of the endless sequence of epochs (each a permutation of the
    rows drawn from ``default_rng([seed, epoch])``)."""
    out = np.empty(len(positions), np.int64)
    epochs = positions // n_rows
    for e in np.unique(epochs):
        perm = np.random.default_rng([seed, int(e)]).permutation(n_rows)
        pick = epochs == e
        out[pick] = perm[positions[pick] % n_rows]
    return out


def steps_for_epochs(epochs: int, n_rows: int, batch_size: int, mix_weight: float = 0.0) -> int:
    """The fewest steps whose batches hold ``epochs`` x ``n_rows`` rows of the main data (the
    rest of each batch mixed in at ``mix_weight``)."""
    need = epochs * n_rows
    k = max(1, math.ceil(need / (batch_size * (1 - mix_weight))) - 1)
    while main_rows_before(k, batch_size, mix_weight) < need:
        k += 1
    return k


def mixed_rows_before(k: int, batch_size: int, weight: float) -> int:
    """Rows of the mixed-in data in batches 0 .. k - 1."""
    return math.floor(k * batch_size * weight)


def main_rows_before(k: int, batch_size: int, weight: float) -> int:
    return k * batch_size - mixed_rows_before(k, batch_size, weight)


class RowBatcher:
    """Batches of packed rows as a pure function of (seed, index); see the module docstring."""

    def __init__(self, packing: Packing, batch_size: int, seed: int):
        self.packing = packing
        self.batch_size = check_int("batch_size", batch_size)
        self.seed = check_int("seed", seed, minimum=0)
        self.seq_len = packing.tokens.shape[1] - 1
        self.n_rows = len(packing.tokens)
        self.batches_per_epoch = self.n_rows / self.batch_size  # may be fractional

    def rows_at(self, positions: np.ndarray) -> dict:
        """The rows at ``positions`` of the endless sequence of epochs."""
        return rows_batch(self.packing, row_order(self.n_rows, self.seed, np.asarray(positions, np.int64)))

    def batch(self, index: int, rows=None) -> dict:
        index = check_int("index", index, minimum=0)
        return _some_rows(self.rows_at(index * self.batch_size + np.arange(self.batch_size)),
                          rows, self.batch_size)

    def __repr__(self) -> str:
        return (f"RowBatcher(rows={self.n_rows}, batch_size={self.batch_size}, seq_len={self.seq_len}, "
                f"seed={self.seed})")


class WindowRows:
    """A token stream's windows (a data.Batcher's) as rows at positions of an endless sequence
    of epochs, with a mask of ones where the stream has none and every row one segment: plain
    text to mix into chat batches."""

    def __init__(self, batcher):
        self.batcher = batcher
        self.batch_size, self.seq_len = batcher.batch_size, batcher.seq_len

    def rows_at(self, positions: np.ndarray) -> dict:
        b = self.batcher
        epochs, k = np.divmod(np.asarray(positions, np.int64), b.n_windows)
        starts = np.array([b.epoch_starts(int(e))[int(i)] for e, i in zip(epochs, k)], np.int64)
        out = _windows(b.ids, starts, b.seq_len, b.mask, None)
        out.setdefault("mask", np.ones_like(out["inputs"]))
        out["segments"] = np.zeros_like(out["inputs"])
        return out


class MixedBatcher:
    """The main data's rows with ``other``'s mixed in at ``weight``; see the module docstring."""

    def __init__(self, main: RowBatcher, other, weight: float, seed: int):
        check_number("mix weight", weight, low=0, high=1, low_open=True, high_open=True)
        self.main, self.other, self.weight, self.seed = main, other, float(weight), seed
        self.batch_size, self.seq_len = main.batch_size, main.seq_len

    def placed(self, index: int) -> np.ndarray:
        """bool (B,): the rows of batch ``index`` that come from the mixed-in data."""
        B, w = self.batch_size, self.weight
        n = mixed_rows_before(index + 1, B, w) - mixed_rows_before(index, B, w)
        at = np.random.default_rng([self.seed, MIX_STREAM, index]).permutation(B)[:n]
        out = np.zeros(B, bool)
        out[at] = True
        return out

    def batch(self, index: int, rows=None) -> dict:
        index = check_int("index", index, minimum=0)
        B, w = self.batch_size, self.weight
        mixed = self.placed(index)
        ours = self.main.rows_at(main_rows_before(index, B, w) + np.arange(int((~mixed).sum())))
        theirs = self.other.rows_at(mixed_rows_before(index, B, w) + np.arange(int(mixed.sum())))
        out = {}
        for key in ("inputs", "targets", "mask", "segments"):
            full = np.zeros((B, self.seq_len), np.int32)
            full[~mixed], full[mixed] = ours[key], theirs[key]
            out[key] = full
        return _some_rows(out, rows, B)


def _some_rows(batch: dict, rows, batch_size: int) -> dict:
    """``batch`` with only ``rows`` kept (the others zero; None: all), as Batcher.batch."""
    if rows is None:
        return batch
    rows = np.asarray(rows, np.int64)
    out = {}
    for key, value in batch.items():
        out[key] = np.zeros_like(value)
        out[key][rows] = value[rows]
    return out


def packed_val_batches(packing: Packing, batch_size: int, max_batches: int) -> list[dict]:
    """Evaluation batches: the rows in order, B at a time (fewer rows than B: one short batch)."""
    R = len(packing.tokens)
    n = max(1, min(max_batches, R // batch_size))
    return [rows_batch(packing, np.arange(k * batch_size, min((k + 1) * batch_size, R))) for k in range(n)]


def parse_mix(spec: str) -> tuple[str, float]:
    """``DATA:WEIGHT`` -> (DATA, WEIGHT), WEIGHT in (0, 1); a ValueError in one line otherwise."""
    path, sep, weight = spec.rpartition(":")
    if not sep or not path:
        raise ValueError(f"--mix {spec!r}: write DATA:WEIGHT (a prepared data folder and the fraction "
                         f"of each batch's rows drawn from it, e.g. data/web:0.2)")
    try:
        w = float(weight)
    except ValueError:
        raise ValueError(f"--mix {spec!r}: the weight {weight!r} is not a number") from None
    if not 0 < w < 1:
        raise ValueError(f"--mix {spec!r}: the weight must be in (0, 1), got {weight}")
    return path, w
