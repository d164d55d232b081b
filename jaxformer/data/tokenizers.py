"""Tokenizers: text or bytes to an int32 id array (N,) and back.

``ByteTokenizer`` is lossless for any file (one id per byte, vocab 256);
``CharTokenizer`` gives one id per character of a UTF-8 text (the vocabulary: the
sorted set of a text's characters); ``HFTokenizer`` (hf_tokenizers.py) is any
Hugging Face tokenizers file, a byte-level BPE trained here or GPT-2's; ``check_encodable``
names the characters of a text a tokenizer cannot encode. ``to_dict`` /
``tokenizer_from_dict`` store any of them in a run's checkpoint and a prepared data
folder; ``make_tokenizer(spec, corpus)`` builds one by name or file.
"""

from __future__ import annotations

import os
from typing import Iterable, Union

import numpy as np

from jaxformer.data.hf_tokenizers import (HFTokenizer, gpt2_tokenizer, hf_from_dict, is_hf_file,
                                          read_tokenizer_json, train_bpe)
from jaxformer.model.validate import as_id_array, validate_ids

Tokenizer = Union["ByteTokenizer", "CharTokenizer", HFTokenizer]


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


class ByteTokenizer:
    """One id per byte: vocab_size 256, lossless for any file, UTF-8 or not."""

    kind = "byte"
    vocab_size = 256
    eot_id = None  # no end-of-text id: documents are joined by a newline

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
    eot_id = None

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

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> "CharTokenizer":
        """The sorted set of the characters of a stream of texts."""
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        if not chars:
            raise ValueError("cannot build a char vocabulary from an empty text")
        return cls(sorted(chars))

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


def check_encodable(tokenizer: Tokenizer, text: str) -> None:
    """ValueError naming the characters of ``text`` that ``tokenizer`` cannot encode, and
    where (a char vocabulary's first unknown one; an HFTokenizer's VocabularyMiss), before
    anything of it is shown or encoded; the byte tokenizer encodes every text."""
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.check_spelled(text)
    elif isinstance(tokenizer, CharTokenizer):
        tokenizer.encode(text)


TOKENIZER_KINDS = ("byte", "char", "bpe", "gpt2")  # or a path to a tokenizer.json


def tokenizer_from_dict(d: dict) -> Tokenizer:
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
    if kind == "hf":
        return hf_from_dict(d)
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of byte, char, hf")


def load_tokenizer_file(path: str) -> Tokenizer:
    """A tokenizer.json: a Hugging Face tokenizers file, or the package's own dict
    (the tokenizer.json of a data folder prepared with a byte or char tokenizer)."""
    if not isinstance(path, str) or not os.path.isfile(path):
        raise ValueError(f"tokenizer file {path!r} does not exist")
    own = read_tokenizer_json(path)
    return tokenizer_from_dict(own) if own is not None else HFTokenizer.from_file(path)


def make_tokenizer(kind: str, corpus: bytes | None = None, vocab_size: int | None = None,
                   texts: Iterable[str] | None = None) -> Tokenizer:
    """A tokenizer by name or file.

    "byte": ByteTokenizer(); "char": the characters of ``corpus`` (UTF-8) or of
    ``texts``; "bpe": a byte-level BPE of ``vocab_size`` tokens trained on them; "gpt2":
    GPT-2's encoding when its tokenizer.json is on the machine; a path: a tokenizer.json.
    ``texts`` (an iterable of str) is read only by "char" and "bpe". ValueError otherwise.
    """
    if kind == "byte":
        return ByteTokenizer()
    if kind in ("char", "bpe"):
        if texts is None:
            if corpus is None:
                raise ValueError(f"the {kind} tokenizer is built from a corpus; none given")
            texts = [_as_text(corpus, "corpus")]
        if kind == "char":
            return CharTokenizer.from_texts(texts)
        if vocab_size is None:
            raise ValueError("--tokenizer bpe needs --vocab-size N")
        return train_bpe(texts, vocab_size)
    if kind == "gpt2":
        return gpt2_tokenizer()
    if isinstance(kind, str) and kind and is_hf_file(kind):
        return load_tokenizer_file(kind)
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {', '.join(TOKENIZER_KINDS)} "
                     "or a path to a tokenizer.json")
