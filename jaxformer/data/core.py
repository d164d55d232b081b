"""Host-side data: tokenizers, corpora, train/validation split and batching (numpy only).

Shape letters as elsewhere: N tokens in a corpus, B batch, T sequence length.

A corpus is bytes (``load_corpus``). A tokenizer turns it into an int32 id array (N,)
and back (``ByteTokenizer``: lossless for any file; ``CharTokenizer``: one id per
character of a UTF-8 text). ``split_train_val`` cuts off the last fraction for
validation, and a ``Batcher`` serves training batches

    {"inputs": int32 (B, T), "targets": int32 (B, T)}    targets[:, t] == inputs[:, t + 1]

as a pure function of ``(seed, index)``, so a run resumed at step ``index`` sees the
very batches an uninterrupted run would have seen.

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
"""

from __future__ import annotations

import importlib.resources
import os
import sysconfig
from typing import Iterable, Iterator, Union

import numpy as np

from jaxformer.model.validate import as_id_array, check_positive_int, validate_ids

Tokenizer = Union["ByteTokenizer", "CharTokenizer"]

DEFAULT_STDLIB_MAX_BYTES = 8 * 1024 * 1024  # 8 MiB: plenty for a small model, quick to read
CORPUS_NAMES = ("default", "stdlib")  # reserved specs; write "./default" for a file so named


# ----------------------------------------------------------------------------
# checks shared by everything below


def _check_nonneg_int(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def _ids_1d(ids, vocab_size: int, name: str = "ids") -> np.ndarray:
    """A scalar or 1-D id array, validated against vocab_size, as int64 (N,)."""
    arr = as_id_array(ids, name)
    if arr.ndim > 1:
        raise ValueError(f"{name} must be a 1-D sequence of ids, got shape {arr.shape}")
    validate_ids(arr, vocab_size, name)
    return arr.reshape(-1).astype(np.int64)


def _as_bytes(data, what: str = "data") -> bytes:
    if isinstance(data, str):
        return data.encode("utf-8", errors="surrogatepass")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise TypeError(f"{what} must be str or bytes, got {type(data).__name__}")


def _as_text(data, what: str = "data") -> str:
    """str as is; bytes decoded as strict UTF-8 (ValueError naming the bad byte offset)."""
    if isinstance(data, str):
        return data
    if isinstance(data, (bytes, bytearray, memoryview)):
        try:
            return bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"{what} is not valid UTF-8 (byte {e.start}: {bytes(data)[e.start:e.start + 1]!r}); "
                f"use the byte tokenizer for arbitrary files"
            ) from None
    raise TypeError(f"{what} must be str or bytes, got {type(data).__name__}")


# ----------------------------------------------------------------------------
# tokenizers


class ByteTokenizer:
    """One id per byte: vocab_size 256, lossless for any file, UTF-8 or not."""

    kind = "byte"
    vocab_size = 256

    def encode(self, data: str | bytes) -> np.ndarray:
        """int32 (N,) of the bytes of data; a str is encoded as UTF-8 first."""
        return np.frombuffer(_as_bytes(data), dtype=np.uint8).astype(np.int32)

    def decode_bytes(self, ids) -> bytes:
        """The exact bytes: decode_bytes(encode(b)) == b for every b."""
        return _ids_1d(ids, self.vocab_size).astype(np.uint8).tobytes()

    def decode(self, ids) -> str:
        """The bytes as text: UTF-8, with U+FFFD for sequences that are not valid."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size}

    def __eq__(self, other) -> bool:
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash(self.kind)

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class CharTokenizer:
    """One id per Unicode character of a vocabulary; id i is ``chars[i]``.

    ``from_text`` builds the vocabulary as the sorted set of a text's characters.
    Encoding a character outside it is an error (a char tokenizer cannot be lossless
    for text it has not seen; use ``ByteTokenizer`` for that).
    """

    kind = "char"

    def __init__(self, chars: Iterable[str]):
        chars = list(chars)
        if not chars:
            raise ValueError("CharTokenizer needs at least one character")
        for i, c in enumerate(chars):
            if not isinstance(c, str) or len(c) != 1:
                raise ValueError(f"CharTokenizer chars[{i}] must be a single character, got {c!r}")
        if len(set(chars)) != len(chars):
            seen = set()
            dup = next(c for c in chars if c in seen or seen.add(c))
            raise ValueError(f"CharTokenizer chars hold {dup!r} more than once")
        self.chars: tuple[str, ...] = tuple(chars)
        self.vocab_size: int = len(chars)
        self._codes = np.array([ord(c) for c in chars], dtype=np.uint32)  # (V,) code points by id
        self._order = np.argsort(self._codes, kind="stable")  # ids sorted by code point
        self._sorted_codes = self._codes[self._order]
        self._table: np.ndarray | None = None  # (max code point + 1,) id or -1, built on first use

    @classmethod
    def from_text(cls, data: str | bytes) -> "CharTokenizer":
        """The sorted set of the characters of data (bytes are decoded as strict UTF-8)."""
        text = _as_text(data, "corpus")
        if not text:
            raise ValueError("cannot build a char vocabulary from an empty text")
        return cls(sorted(set(text)))

    def encode(self, data: str | bytes) -> np.ndarray:
        """int32 (N,), one id per character; ValueError naming the first unknown one."""
        text = _as_text(data)
        codes = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
        ids = self._lookup(codes)
        unknown = ids < 0
        if unknown.any():
            i = int(np.argmax(unknown))
            raise ValueError(
                f"unknown character {text[i]!r} at index {i}: not in the "
                f"{self.vocab_size}-character vocabulary"
            )
        return ids

    def _lookup(self, codes: np.ndarray) -> np.ndarray:
        """int32 ids of code points, -1 where a code point is not in the vocabulary."""
        top = int(self._sorted_codes[-1])
        if top < (1 << 20):  # a dense table: one O(N) gather
            if self._table is None:
                self._table = np.full(top + 1, -1, dtype=np.int32)
                self._table[self._codes] = np.arange(self.vocab_size, dtype=np.int32)
            ids = self._table[np.minimum(codes, top)]
            ids[codes > top] = -1
            return ids
        slot = np.minimum(np.searchsorted(self._sorted_codes, codes), self.vocab_size - 1)
        found = self._sorted_codes[slot] == codes
        return np.where(found, self._order[slot], -1).astype(np.int32)

    def decode(self, ids) -> str:
        """The text of ids; ValueError naming an id outside [0, vocab_size)."""
        codes = self._codes[_ids_1d(ids, self.vocab_size)]
        return codes.astype("<u4").tobytes().decode("utf-32-le", errors="surrogatepass")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size, "chars": list(self.chars)}

    def __eq__(self, other) -> bool:
        return isinstance(other, CharTokenizer) and self.chars == other.chars

    def __hash__(self) -> int:
        return hash((self.kind, self.chars))

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


TOKENIZER_KINDS = ("byte", "char")


def tokenizer_from_dict(d: dict) -> ByteTokenizer | CharTokenizer:
    """Inverse of ``to_dict``; ValueError on an unknown kind or a malformed dict."""
    if not isinstance(d, dict):
        raise ValueError(f"tokenizer dict must be a dict, got {type(d).__name__}")
    kind = d.get("kind")
    if kind == "byte":
        tok = ByteTokenizer()
        if "vocab_size" in d and d["vocab_size"] != tok.vocab_size:
            raise ValueError(f"byte tokenizer dict has vocab_size {d['vocab_size']!r}, expected 256")
        return tok
    if kind == "char":
        chars = d.get("chars")
        if not isinstance(chars, (list, tuple, str)):
            raise ValueError("char tokenizer dict needs 'chars', a list of single characters")
        tok = CharTokenizer(chars)
        if "vocab_size" in d and d["vocab_size"] != tok.vocab_size:
            raise ValueError(
                f"char tokenizer dict has vocab_size {d['vocab_size']!r} but "
                f"{tok.vocab_size} chars"
            )
        return tok
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {', '.join(TOKENIZER_KINDS)}")


def make_tokenizer(kind: str, corpus: bytes) -> ByteTokenizer | CharTokenizer:
    """"byte": ByteTokenizer(); "char": the characters of corpus (UTF-8). ValueError otherwise."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "char":
        return CharTokenizer.from_text(corpus)
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {', '.join(TOKENIZER_KINDS)}")


# ----------------------------------------------------------------------------
# corpora


def _cap(data: bytes, max_bytes: int | None) -> bytes:
    """At most max_bytes of data, cut before a UTF-8 sequence rather than inside it."""
    if max_bytes is None or len(data) <= max_bytes:
        return data
    cut = max_bytes
    while cut > max_bytes - 3 and cut > 0 and (data[cut] & 0xC0) == 0x80:
        cut -= 1  # data[cut] continues a character that starts before the cut
    if (data[cut] & 0xC0) == 0x80:  # not UTF-8 text: cut where asked
        cut = max_bytes
    return data[:cut]


def _concat(paths: list[str], max_bytes: int | None, utf8_only: bool = False) -> bytes:
    """Files concatenated in the given order, a newline added after a file that lacks one;
    reading stops once more than max_bytes are in. utf8_only skips files that are not
    valid UTF-8 (those are read whole)."""
    parts, total = [], 0
    for path in paths:
        want = None if max_bytes is None or utf8_only else max_bytes - total + 4
        with open(path, "rb") as f:
            chunk = f.read() if want is None else f.read(want)
        if not chunk:
            continue
        if utf8_only:
            try:
                chunk.decode("utf-8")
            except UnicodeDecodeError:
                continue
        if (want is None or len(chunk) < want) and not chunk.endswith(b"\n"):
            chunk += b"\n"  # the whole file is in: keep its last line apart from the next file
        parts.append(chunk)
        total += len(chunk)
        if max_bytes is not None and total > max_bytes:
            break
    return _cap(b"".join(parts), max_bytes)


def _files_below(root: str, skip_dir=lambda name: False, keep_file=lambda name: True) -> list[str]:
    """Regular files below root, recursively, sorted by their path relative to root;
    hidden files and folders (a leading '.') skipped, folder links not followed."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not skip_dir(d)]
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not name.startswith(".") and keep_file(name) and os.path.isfile(path):
                found.append(path)
    return sorted(found, key=lambda p: os.path.relpath(p, root).replace(os.sep, "/"))


_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def stdlib_files() -> list[str]:
    """The Python standard library's own .py files (no site-packages, no test folders),
    sorted by path relative to the stdlib folder."""
    root = sysconfig.get_paths()["stdlib"]
    return _files_below(root, skip_dir=_STDLIB_SKIP_DIRS.__contains__,
                        keep_file=lambda name: name.endswith(".py"))


def load_corpus(spec: str, max_bytes: int | None = None) -> bytes:
    """The bytes of a corpus.

    spec:
      "default"  the English text shipped with the package (jaxformer/corpus/default.txt)
      "stdlib"   the standard library's .py sources, sorted by path, concatenated; capped
                 at DEFAULT_STDLIB_MAX_BYTES when max_bytes is None
      a path     a file, or a folder: its regular files, recursively, sorted by relative
                 path, hidden ones skipped, a newline added after a file lacking one

    max_bytes caps the result (cut before, never inside, a UTF-8 character). ValueError
    naming the path when it does not exist, is empty, or a folder holds no files.
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"corpus spec must be a str or a path, got {type(spec).__name__}")
    if max_bytes is not None:
        max_bytes = check_positive_int("max_bytes", max_bytes)
    spec = os.fspath(spec)
    if spec == "default":
        data = importlib.resources.files("jaxformer").joinpath("corpus/default.txt").read_bytes()
        return _cap(data, max_bytes)
    if spec == "stdlib":
        cap = DEFAULT_STDLIB_MAX_BYTES if max_bytes is None else max_bytes
        data = _concat(stdlib_files(), cap, utf8_only=True)  # valid UTF-8: a char vocabulary fits
        if not data:
            raise ValueError(f"no standard library sources found under {sysconfig.get_paths()['stdlib']}")
        return data
    if not spec:
        raise ValueError('corpus spec is empty; give "default", "stdlib" or a path')
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        files = _files_below(path)
        if not files:
            raise ValueError(f"corpus folder {spec!r} holds no files")
        data = _concat(files, max_bytes)
        if not data:
            raise ValueError(f"corpus folder {spec!r} holds only empty files")
        return data
    if os.path.isfile(path):
        with open(path, "rb") as f:
            data = f.read() if max_bytes is None else f.read(max_bytes + 4)
        if not data:
            raise ValueError(f"corpus file {spec!r} is empty")
        return _cap(data, max_bytes)
    if os.path.exists(path):
        raise ValueError(f"corpus path {spec!r} is neither a file nor a folder")
    raise ValueError(
        f"corpus path {spec!r} does not exist (built-in corpora: {', '.join(CORPUS_NAMES)})"
    )


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:,} bytes"


def describe_corpus(spec: str, max_bytes: int | None, n_read: int) -> str:
    """One line: where the corpus comes from, how much of it was read (n_read bytes)
    and any cap, with the flag that changes it."""
    spec = os.fspath(spec)
    if spec == "default":
        where = "default (the English text shipped in jaxformer/corpus/default.txt)"
        total = len(importlib.resources.files("jaxformer").joinpath("corpus/default.txt").read_bytes())
    elif spec == "stdlib":
        where = f"stdlib (the .py sources under {sysconfig.get_paths()['stdlib']})"
        total = sum(os.path.getsize(f) for f in stdlib_files())
    else:
        path = os.path.expanduser(spec)
        files = _files_below(path) if os.path.isdir(path) else [path]
        where = f"{spec} ({len(files)} files)" if os.path.isdir(path) else spec
        total = sum(os.path.getsize(f) for f in files)
    cap = DEFAULT_STDLIB_MAX_BYTES if spec == "stdlib" and max_bytes is None else max_bytes
    if cap is None or total <= cap:
        return f"{where}: {_size(n_read)}"
    why = ("the stdlib default; --max-corpus-bytes N sets another" if max_bytes is None
           else "--max-corpus-bytes")
    return f"{where}: {_size(n_read)} read of {_size(total)} (capped at {_size(cap)}: {why})"


# ----------------------------------------------------------------------------
# split and batching


def split_train_val(ids: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """(train, val): the last floor(N * val_fraction) tokens are validation, the rest train.

    Deterministic and contiguous (no shuffling: neighbouring text would leak across a
    shuffled split). val_fraction in [0, 1); 0 gives an empty validation array.
    """
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"ids must be 1-D, got shape {arr.shape}")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float, np.floating)) \
            or not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be a number in [0, 1), got {val_fraction!r}")
    n_val = int(len(arr) * float(val_fraction))
    n_train = len(arr) - n_val
    if n_train <= 0:
        raise ValueError(f"nothing left to train on: {len(arr)} tokens, val_fraction={val_fraction}")
    return arr[:n_train], arr[n_train:]


class Batcher:
    """Training batches as a pure function of (seed, index); see the module docstring
    for the windowing and the without-replacement sampling."""

    def __init__(self, ids: np.ndarray, batch_size: int, seq_len: int, seed: int):
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.seq_len = check_positive_int("seq_len", seq_len)
        self.seed = _check_nonneg_int("seed", seed)
        arr = as_id_array(ids, "ids")
        if arr.ndim != 1:
            raise ValueError(f"ids must be a 1-D token array, got shape {arr.shape}")
        if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
            raise ValueError("ids do not fit in int32")
        self.ids = np.ascontiguousarray(arr, dtype=np.int32)  # (N,)
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
        epoch = _check_nonneg_int("epoch", epoch)
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
        index = _check_nonneg_int("index", index)
        epoch, k = divmod(index, self.batches_per_epoch)
        starts = self.epoch_starts(epoch)
        if self.n_windows < self.batch_size:  # one batch an epoch: every window, repeated
            return np.resize(starts, self.batch_size)
        return starts[k * self.batch_size:(k + 1) * self.batch_size]

    def batch(self, index: int) -> dict:
        """{"inputs": int32 (B, T), "targets": int32 (B, T)} for step ``index``."""
        return _windows(self.ids, self.batch_starts(index), self.seq_len)

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


def _windows(ids: np.ndarray, starts: np.ndarray, seq_len: int) -> dict:
    rows = ids[starts[:, None] + np.arange(seq_len + 1)]  # (B, T + 1)
    return {"inputs": np.ascontiguousarray(rows[:, :-1]),
            "targets": np.ascontiguousarray(rows[:, 1:])}


def sequential_batches(ids: np.ndarray, batch_size: int, seq_len: int,
                       max_batches: int | None = None) -> Iterator[dict]:
    """Evaluation batches: the windows of ``Batcher`` (stride T, no offset) in corpus
    order, B at a time, so a validation loss is the same every time it is computed.

    Only full batches are yielded, except that a corpus with fewer than B windows gives
    one smaller batch of all of them. ValueError when ids hold fewer than T + 1 tokens.
    """
    batch_size = check_positive_int("batch_size", batch_size)
    seq_len = check_positive_int("seq_len", seq_len)
    if max_batches is not None:
        max_batches = check_positive_int("max_batches", max_batches)
    arr = np.ascontiguousarray(as_id_array(ids, "ids"), dtype=np.int32)
    if arr.ndim != 1:
        raise ValueError(f"ids must be a 1-D token array, got shape {arr.shape}")
    if len(arr) < seq_len + 1:
        raise ValueError(
            f"corpus too short: {len(arr)} tokens, need at least seq_len + 1 = {seq_len + 1}"
        )
    starts = np.arange((len(arr) - 1) // seq_len, dtype=np.int64) * seq_len
    n_batches = max(1, len(starts) // batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for k in range(n_batches):
        yield _windows(arr, starts[k * batch_size:(k + 1) * batch_size], seq_len)
