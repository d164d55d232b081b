"""Subword tokenizers of the Hugging Face ``tokenizers`` library: any tokenizer.json
file (GPT-2's included), a byte-level BPE trained on a corpus, and GPT-2's encoding
when its file is on the machine (nothing is ever downloaded).

``HFTokenizer`` has the interface of the byte and char tokenizers (``encode``,
``decode``, ``vocab_size``, ``kind``, ``to_dict``) plus ``encode_batch`` (the library's
parallel batch encoding) and ``eot_id``, the end-of-text id that joins documents
(None when the vocabulary has none). Its ``to_dict`` holds the whole tokenizer.json,
so a run or a prepared data folder carries its tokenizer with it.

A character the vocabulary cannot spell (a byte-level vocabulary without one of its
bytes' symbols, or a vocabulary without an unknown token that has no piece for it) would
vanish from the ids without a word: ``encode`` and ``encode_batch`` refuse such a text with
a ``VocabularyMiss`` naming the characters and where they stand (line, column), so
``prepare`` and a ``generate`` prompt both say it.

``tokenizers`` is imported inside the functions that need it (an optional heavy
dependency for the rest of the package).
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Iterable

import numpy as np

from jaxformer.model.checks import check_int
from jaxformer.model.validate import as_id_array, validate_ids

EOT_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")  # first found is the eot id
GPT2_ENV = "JAXFORMER_GPT2_TOKENIZER"  # a path to GPT-2's tokenizer.json
GPT2_VOCAB_SIZE = 50257


def _library():
    try:
        import tokenizers
    except ImportError:
        raise ValueError("subword tokenizers need the `tokenizers` package: pip install tokenizers") from None
    return tokenizers


class VocabularyMiss(ValueError):
    """A text holds characters the tokenizer's vocabulary lacks: encoding would drop them.
    ``misses``: [(character, line, column)] (1-based), the first of each character."""

    def __init__(self, name: str, misses: list[tuple[str, int, int]]):
        self.misses = misses
        shown = "; ".join(f"{c!r} (U+{ord(c):04X}) at line {line}, column {col}" for c, line, col in misses[:5])
        more = f"; and {len(misses) - 5} more" if len(misses) > 5 else ""
        super().__init__(f"the vocabulary of {name} lacks {len(misses)} character(s) of the text, which "
                         f"encoding would drop: {shown}{more}")


def _positions(text: str, indices) -> list[tuple[str, int, int]]:
    """(character, line, column) of the first occurrence of each distinct character at ``indices``."""
    seen, out = set(), []
    for i in sorted(int(i) for i in indices):
        if text[i] in seen:
            continue
        seen.add(text[i])
        line = text.count("\n", 0, i) + 1
        out.append((text[i], line, i - (text.rfind("\n", 0, i) + 1) + 1))
    return out


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with the package's tokenizer interface."""

    kind = "hf"

    def __init__(self, tokenizer, name: str = "tokenizer.json"):
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer
        self.name = name
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        ids = [tokenizer.token_to_id(t) for t in EOT_TOKENS]
        self.eot_id: int | None = next((i for i in ids if i is not None), None)
        self._gaps = None  # what the vocabulary cannot spell (_vocabulary_gaps), found on first use

    @classmethod
    def from_str(cls, text: str, name: str = "tokenizer.json") -> "HFTokenizer":
        try:
            return cls(_library().Tokenizer.from_str(text), name)
        except Exception as e:  # the library raises its own Exception type
            raise ValueError(f"{name} is not a tokenizers file: {str(e).splitlines()[0]}") from None

    @classmethod
    def from_file(cls, path) -> "HFTokenizer":
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ValueError(f"tokenizer file {path!r} does not exist")
        with open(path, encoding="utf-8") as f:
            return cls.from_str(f.read(), os.path.basename(path))

    def encode(self, data: str | bytes) -> np.ndarray:
        """int32 (N,) ids of a text (bytes are decoded as strict UTF-8)."""
        if isinstance(data, (bytes, bytearray, memoryview)):
            try:
                data = bytes(data).decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"data is not valid UTF-8 (byte {e.start}); the {self.name} "
                                 "tokenizer reads text") from None
        self.check_spelled(data)
        return np.asarray(self.tokenizer.encode(data, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """int32 ids of each text, encoded in parallel by the library (VocabularyMiss as
        ``encode``'s, for the first text with a character the vocabulary lacks)."""
        for text in texts:
            self.check_spelled(text)
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def check_spelled(self, text: str) -> None:
        """VocabularyMiss naming the characters of ``text`` that encoding drops: in a
        byte-level vocabulary a character with a byte whose symbol it lacks; in a BPE without
        an unknown token or byte fallback a character (whitespace apart) it has no token for.
        An added token's text is one id, whatever its characters."""
        missing, special, spelled = self._vocabulary_gaps()
        if missing is not None:
            if not len(missing):
                return
            raw = np.frombuffer(text.encode("utf-8", errors="surrogatepass"), np.uint8)
            hit = np.isin(raw, missing)
            if not hit.any():
                return
            char_of_byte = np.cumsum((raw & 0xC0) != 0x80) - 1  # a UTF-8 byte -> its character
            lost = np.zeros(len(text), bool)
            lost[char_of_byte[hit]] = True
        elif spelled is not None:
            bad = {c for c in set(text) if not c.isspace() and not spelled(c)}
            if not bad:
                return
            lost = np.array([c in bad for c in text], bool)
        else:
            return
        for m in special.finditer(text) if special is not None else ():
            lost[m.start():m.end()] = False
        if lost.any():
            raise VocabularyMiss(self.name, _positions(text, np.flatnonzero(lost)))

    def _vocabulary_gaps(self):
        """(the bytes a byte-level vocabulary lacks, uint8 (k,), or None when it is not
        byte-level; a pattern of the added tokens' texts, or None; for a BPE that drops a
        character it has no token for, character -> whether it has one, else None)."""
        if self._gaps is None:
            lib = _library()
            tok, model = self.tokenizer, self.tokenizer.model
            missing = spelled = None
            if isinstance(tok.decoder, lib.decoders.ByteLevel) or isinstance(tok.pre_tokenizer,
                                                                              lib.pre_tokenizers.ByteLevel):
                alphabet = _byte_symbols()
                missing = np.array([b for b in range(256) if tok.token_to_id(alphabet[b]) is None], np.uint8)
            elif isinstance(model, lib.models.BPE) and model.unk_token is None and not model.byte_fallback:
                forms = [("", ""), (model.continuing_subword_prefix or "", ""), ("", model.end_of_word_suffix or "")]
                spelled = lambda c: any(tok.token_to_id(a + c + b) is not None for a, b in forms)  # noqa: E731
            added = sorted((t.content for t in tok.get_added_tokens_decoder().values() if t.content),
                           key=len, reverse=True)
            special = re.compile("|".join(map(re.escape, added))) if added else None
            self._gaps = (missing, special, spelled)
        return self._gaps

    def decode(self, ids) -> str:
        arr = as_id_array(ids, "ids").reshape(-1)
        validate_ids(arr, self.vocab_size, "ids")
        return self.tokenizer.decode(arr.tolist(), skip_special_tokens=False)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "name": self.name, "vocab_size": self.vocab_size,
                "json": self.tokenizer.to_str()}

    def __eq__(self, other) -> bool:
        return isinstance(other, HFTokenizer) and self.tokenizer.to_str() == other.tokenizer.to_str()

    def __hash__(self) -> int:
        return hash((self.kind, self.vocab_size, self.name))

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size})"


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: byte b -> the printable character that stands for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def hf_from_dict(d: dict) -> HFTokenizer:
    if not isinstance(d.get("json"), str):
        raise ValueError("hf tokenizer dict needs 'json', the tokenizer.json text")
    tok = HFTokenizer.from_str(d["json"], d.get("name", "tokenizer.json"))
    if "vocab_size" in d and d["vocab_size"] != tok.vocab_size:
        raise ValueError(f"hf tokenizer dict has vocab_size {d['vocab_size']!r} but its "
                         f"tokenizer.json holds {tok.vocab_size} tokens")
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE (GPT-2's pre-tokenization and byte alphabet) of ``vocab_size``
    tokens, <|endoftext|> included, trained on ``texts``."""
    lib = _library()
    vocab_size = check_int("--vocab-size", vocab_size, minimum=257,
                           note="a byte-level BPE holds the 256 bytes and <|endoftext|>")
    tok = lib.Tokenizer(lib.models.BPE())
    tok.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = lib.decoders.ByteLevel()
    trainer = lib.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok, f"bpe-{vocab_size}")


def gpt2_candidates() -> list[str]:
    """Where GPT-2's tokenizer.json is looked for: $JAXFORMER_GPT2_TOKENIZER, then the
    Hugging Face hub cache (a model folder of gpt2 already downloaded)."""
    found = [os.environ[GPT2_ENV]] if os.environ.get(GPT2_ENV) else []
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    for model in ("models--gpt2", "models--openai-community--gpt2"):
        found += sorted(glob.glob(os.path.join(hub, model, "snapshots", "*", "tokenizer.json")))
    return found


def gpt2_tokenizer() -> HFTokenizer:
    """GPT-2's encoding from a tokenizer.json on the machine; ValueError saying how to
    provide one when there is none."""
    for path in gpt2_candidates():
        if os.path.isfile(path):
            tok = HFTokenizer.from_file(path)
            if tok.vocab_size != GPT2_VOCAB_SIZE:
                raise ValueError(f"{path} holds {tok.vocab_size} tokens, not GPT-2's {GPT2_VOCAB_SIZE}")
            tok.name = "gpt2"
            return tok
    raise ValueError(
        f"GPT-2's tokenizer.json is not on this machine: set {GPT2_ENV}=/path/to/tokenizer.json "
        "(from the gpt2 model on the Hugging Face hub), or pass --tokenizer /path/to/tokenizer.json")


def is_hf_file(path: str) -> bool:
    """Whether a tokenizer spec names a file rather than a kind."""
    return path.endswith(".json") or os.sep in path or os.path.isfile(path)


def read_tokenizer_json(path: str) -> dict | None:
    """The package's own tokenizer dict when ``path`` holds one (a prepared folder's
    tokenizer.json of a byte or char tokenizer), else None (a tokenizers file)."""
    with open(path, encoding="utf-8") as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"tokenizer file {path!r} is not JSON: {e}") from None
    return d if isinstance(d, dict) and d.get("kind") in ("byte", "char", "hf") else None
