"""Subword tokenizers of the Hugging Face ``tokenizers`` library: any tokenizer.json
file (GPT-2's included), a byte-level BPE trained on a corpus, and GPT-2's encoding
when its file is on the machine (nothing is ever downloaded).

``HFTokenizer`` has the interface of the byte and char tokenizers (``encode``,
``decode``, ``vocab_size``, ``kind``, ``to_dict``) plus ``encode_batch`` (the library's
parallel batch encoding) and ``eot_id``, the end-of-text id that joins documents
(None when the vocabulary has none). Its ``to_dict`` holds the whole tokenizer.json,
so a run or a prepared data folder carries its tokenizer with it.

``tokenizers`` is imported inside the functions that need it (an optional heavy
dependency for the rest of the package).
"""

from __future__ import annotations

import glob
import json
import os
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


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with the package's tokenizer interface."""

    kind = "hf"

    def __init__(self, tokenizer, name: str = "tokenizer.json"):
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer
        self.name = name
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        ids = [tokenizer.token_to_id(t) for t in EOT_TOKENS]
        self.eot_id: int | None = next((i for i in ids if i is not None), None)

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
        return np.asarray(self.tokenizer.encode(data, add_special_tokens=False).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """int32 ids of each text, encoded in parallel by the library."""
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

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
