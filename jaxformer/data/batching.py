"""The train/validation split and batching of token ids (numpy only).

Shape letters as elsewhere: N tokens in a corpus, B batch, T sequence length.

``split_train_val`` cuts off the last fraction of a corpus's ids for validation, and
a ``Batcher`` serves training batches

    {"inputs": int32 (B, T), "targets": int32 (B, T)}    targets[:, t] == inputs[:, t + 1]

plus ``"mask": int32 (B, T)`` (the loss mask of each target, 0 or 1) when the ids carry
one (a chat data folder's shards: ``ShardedTokens.mask``, or ``mask=`` given), and with
``segments=True`` ``"segments": int32 (B, T)``, each input's document within its row (0, 1,
...: the count of document starts after the row's first token up to it), from the document
starts a chat data folder's shards carry (``ShardedTokens.docs``), as a pure
function of ``(seed, index)``, so a run resumed at step ``index`` sees the
very batches an uninterrupted run would have seen. ``sequential_batches`` gives the
validation batches, the same every time. ``random_batch`` is a batch of uniform random
ids in the same layout, for timing and memory measurements that need no text.

Windows (the choice, and why): the corpus is cut into non-overlapping windows of
T + 1 tokens with stride T (neighbouring windows share one token, the last target
of one being the first input of the next), so one epoch predicts every covered
token exactly once. Each epoch shifts the whole grid by a random offset inside the
slack the grid leaves at the end of the corpus, and visits the windows in a random
order; both are drawn from ``np.random.default_rng([seed, epoch])``. Within an
epoch windows are drawn without replacement: the ``n_windows % B`` windows that do
not fill a last batch are skipped for that epoch (a different few each epoch). When
the corpus holds fewer windows than one batch, an epoch is a single batch holding
every window, the permutation repeated to fill B rows, so each window appears
floor(B / n_windows) or ceil(B / n_windows) times.

The ids may be an in-memory array or the memory-mapped shards of a prepared data
folder (``shards.ShardedTokens``): the same tokens give the same windows, and the
shards are read a window at a time, never whole.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from jaxformer.data.shards import ShardedTokens
from jaxformer.model.checks import check_int, check_number
from jaxformer.model.config import ModelConfig
from jaxformer.model.validate import as_id_array


def random_batch(config: ModelConfig, batch_size: int, seq_len: int, seed: int = 0) -> dict:
    """{"inputs", "targets"}: int32 (B, T) numpy arrays cut from B rows of T + 1 ids drawn
    uniformly from [0, config.vocab_size) with ``np.random.default_rng(seed)``, the targets
    the inputs shifted by one (as a Batcher's)."""
    batch_size, seq_len = check_int("batch_size", batch_size), check_int("seq_len", seq_len)
    rng = np.random.default_rng(check_int("seed", seed, minimum=0))
    tokens = rng.integers(0, config.vocab_size, size=(batch_size, seq_len + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def split_train_val(ids: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): the last floor(N * val_fraction) tokens are validation, the rest train.

    Deterministic and contiguous (no shuffling: neighbouring text would leak across a
    shuffled split). val_fraction in [0, 1); 0 gives an empty validation array.
    """
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"ids must be 1-D, got shape {arr.shape}")
    check_number("val_fraction", val_fraction, low=0, high=1, high_open=True)
    n_val = int(len(arr) * float(val_fraction))
    n_train = len(arr) - n_val
    if n_train <= 0:
        raise ValueError(f"nothing left to train on: {len(arr)} tokens, val_fraction={val_fraction}")
    return arr[:n_train], arr[n_train:]


class Batcher:
    """Training batches as a pure function of (seed, index); see the module docstring
    for the windowing and the without-replacement sampling."""

    def __init__(self, ids: np.ndarray, batch_size: int, seq_len: int, seed: int, mask=None,
                 segments: bool = False):
        self.batch_size = check_int("batch_size", batch_size)
        self.seq_len = check_int("seq_len", seq_len)
        self.seed = check_int("seed", seed, minimum=0)
        self.ids = _token_source(ids)  # (N,): int32 in memory, or shards.ShardedTokens (memory-mapped)
        self.mask = _mask_source(self.ids, mask)  # (N,) 0/1 loss mask of each token, or None
        self.docs = _doc_source(self.ids, segments)  # (N,) 1 on each document's first token, or None
        n, t = len(self.ids), self.seq_len
        if n < t + 1:
            raise ValueError(
                f"corpus too short: {n} tokens, need at least seq_len + 1 = {t + 1}"
            )
        self.n_windows = (n - 1) // t  # windows of T + 1 tokens at stride T
        self.slack = (n - 1) - self.n_windows * t  # room to shift the grid, in [0, T)
        self.batches_per_epoch = max(1, self.n_windows // self.batch_size)
        self._cache: tuple[int, np.ndarray] | None = None

    def epoch_starts(self, epoch: int) -> np.ndarray:
        """int64 (n_windows,): the window starts of an epoch in visiting order."""
        epoch = check_int("epoch", epoch, minimum=0)
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        rng = np.random.default_rng([self.seed, epoch])
        offset = int(rng.integers(0, self.slack + 1))
        starts = offset + rng.permutation(self.n_windows).astype(np.int64) * self.seq_len
        starts.setflags(write=False)  # cached: shared between calls
        self._cache = (epoch, starts)
        return starts

    def batch_starts(self, index: int) -> np.ndarray:
        """int64 (B,): the window starts of batch ``index``."""
        index = check_int("index", index, minimum=0)
        epoch, k = divmod(index, self.batches_per_epoch)
        starts = self.epoch_starts(epoch)
        if self.n_windows < self.batch_size:  # one batch an epoch: every window, repeated
            return np.resize(starts, self.batch_size)
        return starts[k * self.batch_size:(k + 1) * self.batch_size]

    def batch(self, index: int, rows=None) -> dict:
        """{"inputs": int32 (B, T), "targets": int32 (B, T)} for step ``index``.

        rows: the row indices to read (a process reads only the rows it places on
        its devices); the others are left zero. None: every row."""
        starts = self.batch_starts(index)
        if rows is None:
            return _windows(self.ids, starts, self.seq_len, self.mask, self.docs)
        rows = np.asarray(rows, dtype=np.int64)
        part = _windows(self.ids, starts[rows], self.seq_len, self.mask, self.docs)
        out = {}
        for key, value in part.items():
            out[key] = np.zeros((self.batch_size, self.seq_len), np.int32)
            out[key][rows] = value
        return out

    def __iter__(self) -> Iterator[dict]:
        """Batches 0, 1, 2, ... without end."""
        index = 0
        while True:
            yield self.batch(index)
            index += 1

    def __repr__(self) -> str:
        return (f"Batcher(tokens={len(self.ids)}, batch_size={self.batch_size}, "
                f"seq_len={self.seq_len}, seed={self.seed}, n_windows={self.n_windows}, "
                f"batches_per_epoch={self.batches_per_epoch})")


def _token_source(ids):
    """ids as the batcher reads them: a memory-mapped ``ShardedTokens`` as it is (never
    read whole), anything else as an int32 (N,) array."""
    if isinstance(ids, ShardedTokens):
        return ids
    arr = as_id_array(ids, "ids")
    if arr.ndim != 1:
        raise ValueError(f"ids must be a 1-D token array, got shape {arr.shape}")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise ValueError("ids do not fit in int32")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _mask_source(ids, mask):
    """The loss mask of ``ids``: ``mask`` as an int32 (N,) array of 0/1, else the mask a
    chat data folder's shards carry, else None."""
    if mask is None:
        return ids.mask if isinstance(ids, ShardedTokens) else None
    if isinstance(mask, ShardedTokens):
        found = mask
    else:
        found = np.ascontiguousarray(np.asarray(mask).reshape(-1), dtype=np.int32)
        if found.size and (found.min() < 0 or found.max() > 1):
            raise ValueError("mask must hold 0 and 1 only (the loss mask of each token)")
    if len(found) != len(ids):
        raise ValueError(f"mask holds {len(found)} entries for {len(ids)} tokens")
    return found


def _doc_source(ids, segments: bool):
    """The document starts the shards carry when ``segments`` is asked for (None otherwise);
    a ValueError when the ids have none."""
    if not segments:
        return None
    check_doc_starts(ids)
    return ids.docs


def check_doc_starts(ids) -> None:
    """A ValueError when ``ids`` carry no document starts (packed_documents needs them)."""
    if getattr(ids, "docs", None) is None:
        raise ValueError("packed_documents needs the document starts a chat data folder carries "
                         "(`jaxformer prepare` of a chat JSONL file, then --data DATA_DIR)")


def _gather(ids, starts: np.ndarray, length: int) -> np.ndarray:
    if isinstance(ids, ShardedTokens):
        return ids.rows(starts, length)  # (B, length), read from the mapped shards
    return ids[starts[:, None] + np.arange(length)]  # (B, length)


def _windows(ids, starts: np.ndarray, seq_len: int, mask=None, docs=None) -> dict:
    rows = _gather(ids, starts, seq_len + 1)  # (B, T + 1)
    out = {"inputs": np.ascontiguousarray(rows[:, :-1]),
           "targets": np.ascontiguousarray(rows[:, 1:])}
    if mask is not None:  # the mask of each target token
        out["mask"] = np.ascontiguousarray(_gather(mask, starts, seq_len + 1)[:, 1:], dtype=np.int32)
    if docs is not None:  # the document of each input token: starts counted along the row
        first = _gather(docs, starts, seq_len)  # (B, T)
        first[:, 0] = 0  # the row's first token continues whatever document it is in
        out["segments"] = np.cumsum(first, axis=1, dtype=np.int32)
    return out


def sequential_batches(ids: np.ndarray, batch_size: int, seq_len: int,
                       max_batches: int | None = None, mask=None, segments: bool = False) -> Iterator[dict]:
    """Evaluation batches: the windows of ``Batcher`` (stride T, no offset) in corpus
    order, B at a time, so a validation loss is the same every time it is computed.

    Only full batches are yielded, except that a corpus with fewer than B windows gives
    one smaller batch of all of them. ValueError when ids hold fewer than T + 1 tokens.
    ``mask`` (or the mask of memory-mapped chat shards): each batch's "mask"; ``segments``:
    each batch's "segments", as Batcher's.
    """
    batch_size = check_int("batch_size", batch_size)
    seq_len = check_int("seq_len", seq_len)
    if max_batches is not None:
        max_batches = check_int("max_batches", max_batches)
    arr = _token_source(ids)
    mask = _mask_source(arr, mask)
    docs = _doc_source(arr, segments)
    if len(arr) < seq_len + 1:
        raise ValueError(
            f"corpus too short: {len(arr)} tokens, need at least seq_len + 1 = {seq_len + 1}"
        )
    starts = np.arange((len(arr) - 1) // seq_len, dtype=np.int64) * seq_len
    n_batches = max(1, len(starts) // batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for k in range(n_batches):
        yield _windows(arr, starts[k * batch_size:(k + 1) * batch_size], seq_len, mask, docs)
