"""A prepared data folder: flat token shards and their meta.json, read back memory-mapped.

Layout of DATA_DIR (written by ``prepare.prepare``)::

    meta.json          what follows; written last, so its presence means complete
    tokenizer.json     the tokenizer (a tokenizers file, or the package's dict for byte/char)
    train_00000.bin    token ids, flat, little-endian ``dtype`` (uint16 or uint32)
    val_00000.bin      ...
    train_00000.mask   chat data only: the loss mask of each token, uint8 0/1, one byte a token
    train_00000.doc    chat data only: 1 on each document's (conversation's) first token, else 0

meta.json fields: ``format`` ("jaxformer-shards"), ``version`` (1), ``dtype``,
``tokenizer`` (its ``to_dict``, as runs save it), ``vocab_size``, ``source`` (corpus
spec, text field, val fraction, shard tokens), ``documents`` and ``bytes`` (of UTF-8 text) read,
``splits``: {"train"|"val": {"tokens": n, "shards": [{"file", "tokens", "sha256"}]}}.
Chat data (data/chat.py) adds ``mask`` (true), ``chat`` (the template and counts) and, per
shard, ``mask_file`` and ``mask_sha256``; a folder without them has no mask. ``doc_starts``
(true) with ``doc_file`` and ``doc_sha256`` per shard: the document starts, from which the
batcher numbers each row's documents (packed-document attention, batch["segments"]).

``open_split`` maps a split's shards (``np.memmap``, nothing read until a window is
asked for) as one ``ShardedTokens`` sequence (its ``mask``: the masks the same way, or
None); ``verify`` re-hashes every shard and mask.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

META_FILE, TOKENIZER_FILE, FORMAT, VERSION = "meta.json", "tokenizer.json", "jaxformer-shards", 1
SPLITS = ("train", "val")


def shard_name(split: str, k: int) -> str:
    return f"{split}_{k:05d}.bin"


def mask_name(split: str, k: int) -> str:
    return f"{split}_{k:05d}.mask"


def doc_name(split: str, k: int) -> str:
    return f"{split}_{k:05d}.doc"


def _files(meta: dict, split: str):
    """(file, bytes, sha256, what it holds) of each shard of a split and of its mask."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    for shard in meta["splits"][split]["shards"]:
        n = shard["tokens"]
        yield shard["file"], n * itemsize, shard["sha256"], f"{n} {meta['dtype']} tokens"
        if "mask_file" in shard:
            yield shard["mask_file"], n, shard["mask_sha256"], f"the uint8 mask of {n} tokens"
        if "doc_file" in shard:
            yield shard["doc_file"], n, shard["doc_sha256"], f"the uint8 document starts of {n} tokens"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def file_sha256(path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """data at path, complete or not at all: a temporary name, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_meta(data_dir) -> dict:
    """meta.json of a prepared folder; ValueError in one line when it is missing or bad."""
    path = Path(data_dir) / META_FILE
    if not Path(data_dir).is_dir():
        raise ValueError(f"data folder {data_dir} does not exist; make it with `jaxformer prepare`")
    if not path.is_file():
        raise ValueError(f"{data_dir} holds no {META_FILE}: not a prepared data folder (or its "
                         "prepare did not finish); run `jaxformer prepare --out "
                         f"{data_dir} ...`")
    try:
        meta = json.loads(path.read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        np.dtype(meta["dtype"])
        for split in SPLITS:
            for shard in meta["splits"][split]["shards"]:
                shard["file"], shard["tokens"], shard["sha256"]  # noqa: B018 (present)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a valid meta.json ({type(e).__name__}: {e})") from None
    return meta


def check_sizes(data_dir, meta: dict) -> None:
    """Every shard (and mask) exists with the size meta.json says (cheap: no reading)."""
    for split in SPLITS:
        for name, want, _, what in _files(meta, split):
            path = Path(data_dir) / name
            if not path.is_file():
                raise ValueError(f"shard {path} listed in {META_FILE} is missing")
            if path.stat().st_size != want:
                raise ValueError(f"shard {path} holds {path.stat().st_size} bytes but {META_FILE} says "
                                 f"{what} ({want} bytes); prepare the folder again")


def verify(data_dir, meta: dict | None = None) -> int:
    """Sizes and sha256 of every shard and mask against meta.json; returns the shard count."""
    meta = meta or read_meta(data_dir)
    check_sizes(data_dir, meta)
    for split in SPLITS:
        for name, _, digest, _ in _files(meta, split):
            path = Path(data_dir) / name
            if file_sha256(path) != digest:
                raise ValueError(f"shard {path} does not match its sha256 in {META_FILE} "
                                 "(changed or damaged); prepare the folder again")
    return sum(len(meta["splits"][split]["shards"]) for split in SPLITS)


def fingerprint_of(meta: dict) -> str:
    """One sha256 over the shard digests of both splits (no shard is read)."""
    digests = {split: [s["sha256"] for s in meta["splits"][split]["shards"]] for split in SPLITS}
    if meta.get("mask"):
        digests["mask"] = [s.get("mask_sha256") for split in SPLITS for s in meta["splits"][split]["shards"]]
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()


class ShardedTokens:
    """A split's shards as one read-only sequence of N token ids, memory-mapped.

    ``rows(starts, length)`` gathers int32 (len(starts), length) windows, a window
    running across a shard's end continuing in the next shard. ``mask``: the loss mask
    of each token (a ShardedTokens of 0/1, the same length), or None; ``docs``: 1 on each
    document's first token (the same way), or None."""

    def __init__(self, arrays: list[np.ndarray], mask: "ShardedTokens | None" = None,
                 docs: "ShardedTokens | None" = None):
        self.mask, self.docs = mask, docs
        if mask is not None and len(mask) != sum(len(a) for a in arrays):
            raise ValueError(f"the mask holds {len(mask)} entries for {sum(len(a) for a in arrays)} tokens")
        self.arrays = [a for a in arrays if len(a)]
        sizes = np.array([len(a) for a in self.arrays], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])  # (shards + 1,)
        self.size = int(self.offsets[-1])

    def __len__(self) -> int:
        return self.size

    def rows(self, starts: np.ndarray, length: int) -> np.ndarray:
        out = np.empty((len(starts), length), dtype=np.int32)
        for i, start in enumerate(np.asarray(starts, dtype=np.int64)):
            pos, filled = int(start), 0
            while filled < length:
                k = int(np.searchsorted(self.offsets, pos, side="right")) - 1
                a = self.arrays[k]
                lo = pos - int(self.offsets[k])
                take = min(length - filled, len(a) - lo)
                out[i, filled:filled + take] = a[lo:lo + take]
                filled, pos = filled + take, pos + take
        return out

    def __array__(self, dtype=None, copy=None):
        """The whole split in memory (small splits only: evaluation of a short split)."""
        whole = self.rows(np.zeros(1, np.int64), self.size)[0] if self.size else np.zeros(0, np.int32)
        return whole if dtype is None else whole.astype(dtype)


def open_split(data_dir, meta: dict, split: str) -> ShardedTokens:
    """The memory-mapped shards of ``split`` ("train" or "val"), with their masks when the
    folder holds chat data."""
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    listed = [s for s in meta["splits"][split]["shards"] if s["tokens"]]
    arrays = [np.memmap(Path(data_dir) / s["file"], dtype=dtype, mode="r", shape=(s["tokens"],))
              for s in listed]
    def side(field):
        return ShardedTokens([np.memmap(Path(data_dir) / s[field], dtype=np.uint8, mode="r",
                                        shape=(s["tokens"],)) for s in listed])

    return ShardedTokens(arrays, side("mask_file") if meta.get("mask") else None,
                         side("doc_file") if meta.get("doc_starts") else None)
