"""Tokenize a corpus once into flat token shards (``jaxformer prepare``).

The corpus streams in (sources.py): pieces of at most about a MiB or one record at a
time, tokenized in batches (the ``tokenizers`` library encodes a batch on all cores),
documents joined by the tokenizer's end-of-text id (by a newline for the byte and
char tokenizers, which have none). Memory stays bounded by one shard.

The validation split: the token stream is cut into consecutive spans of
``shard_tokens``; the last ``floor(span * val_fraction)`` tokens of each span are
validation (val_K.bin), the rest training (train_K.bin); the final, shorter span is
split the same way. A corpus that fits one span is split exactly as
``split_train_val`` splits it in memory. The "char" vocabulary and the "bpe" merges
are learned in a first pass over the whole stream (a char vocabulary must cover the
validation text too; for bpe this lets validation text take part in the merge counts).

Chat data (a JSONL file of {"messages": [...]} or {"prompt", "completion"} records, with a
tokenizer that has a chat template: a model folder or a .gguf file) is rendered by chat.py,
conversations joined by the end-of-text id, and each shard gets a mask file beside it
(train_K.mask: uint8, 1 on the assistant's tokens), split and cut exactly as its tokens.

Atomic: every file is written under a temporary name, fsynced and renamed, and
meta.json comes last, so a folder with meta.json is complete. A finished folder
asked again for the same thing is verified and left alone; a folder without
meta.json (an interrupted prepare) has its partial shards removed and starts over.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from tqdm import tqdm  # the text bar everywhere: tqdm.auto warns in Jupyter without ipywidgets

from jaxformer.data import chat as chat_data
from jaxformer.data import shards
from jaxformer.data.sources import Piece, pieces, total_bytes
from jaxformer.data.tokenizers import make_tokenizer
from jaxformer.model.checks import check_int, check_number

DEFAULT_SHARD_TOKENS = 1 << 25  # 32 Mi tokens: 64 MiB of uint16
BATCH_BYTES = 8 << 20  # text tokenized per batch


class PrepareResult(dict):
    """meta.json's contents, with ``done_before``: the folder was already prepared."""

    done_before = False


def _text(piece: Piece) -> str:
    """A piece as text: strict UTF-8, naming the file and byte offset of a bad byte."""
    if isinstance(piece.data, str):
        return piece.data
    try:
        return piece.data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{piece.where} is not valid UTF-8 at byte {piece.offset + e.start} "
                         f"({piece.data[e.start:e.start + 1]!r}); use --tokenizer byte for such files"
                         ) from None


def _batches(stream: Iterator[Piece]) -> Iterator[list[Piece]]:
    batch, size = [], 0
    for piece in stream:
        batch.append(piece)
        size += len(piece.data)
        if size >= BATCH_BYTES or len(batch) >= 4096:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _bytes(piece: Piece) -> bytes:
    """A piece as UTF-8 bytes (what the byte tokenizer reads)."""
    return piece.data if isinstance(piece.data, bytes) else piece.data.encode("utf-8")


def _text_bytes(piece: Piece) -> int:
    """The UTF-8 bytes of a piece's text (a record's text is a str: its length counts characters)."""
    return len(piece.data) if isinstance(piece.data, bytes) else len(piece.data.encode("utf-8"))


def _encode_each(tokenizer, batch: list[Piece], datas: list) -> list[np.ndarray]:
    """tokenizer.encode of each piece; a character the vocabulary lacks names its piece."""
    encoded = []
    for piece, data in zip(batch, datas):
        try:
            encoded.append(tokenizer.encode(data))
        except ValueError as e:
            raise ValueError(f"{_place(piece)}: {e}") from None
    return encoded


def _place(piece: Piece) -> str:
    """Where a piece stands: a record's file and line; a text file, and the byte its piece
    starts at when not the first (a line of the message then counts from there)."""
    if isinstance(piece.data, str):
        return f"{piece.where}:{piece.offset}"
    return piece.where if piece.offset == 0 else f"{piece.where} (the part from byte {piece.offset:,})"


def encode_stream(tokenizer, stream: Iterator[Piece], bar=None) -> Iterator[np.ndarray]:
    """The token ids of a stream of pieces, a batch at a time, documents joined. The byte
    tokenizer reads every piece as UTF-8 bytes (a record's text is a str), the others as
    text (a text file's piece is bytes); ``bar`` counts the UTF-8 bytes of the text."""
    eot = getattr(tokenizer, "eot_id", None)
    as_data, newline = (_bytes, b"\n") if tokenizer.kind == "byte" else (_text, "\n")
    first, ends_newline = True, True
    for batch in _batches(stream):
        datas = [as_data(p) for p in batch]  # all bytes or all str
        if hasattr(tokenizer, "encode_batch"):
            try:
                encoded = tokenizer.encode_batch(datas)
            except ValueError:  # one piece's characters the vocabulary lacks: named with the piece
                encoded = _encode_each(tokenizer, batch, datas)
        else:
            encoded = _encode_each(tokenizer, batch, datas)
        for piece, data, ids in zip(batch, datas, encoded):
            if piece.new_doc and not first:
                if eot is not None:
                    yield np.array([eot], np.int32)
                elif not ends_newline:
                    yield tokenizer.encode(newline)
            first = False
            if len(data):
                ends_newline = data[-1:] == newline
            yield ids
            if bar is not None:
                bar.update(len(data) if isinstance(data, bytes) else _text_bytes(piece))


class ShardWriter:
    """Token ids (and, for chat data, their loss mask) in, train and val shards out (see
    the module docstring for the split)."""

    def __init__(self, out: Path, dtype: np.dtype, span: int, val_fraction: float):
        self.out, self.dtype, self.span, self.val_fraction = out, dtype, span, val_fraction
        self.parts, self.masks, self.docs, self.held = [], [], [], 0
        self.written = {split: [] for split in shards.SPLITS}

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None, doc: np.ndarray | None = None) -> None:
        """ids, their loss mask (chat data) and their document starts (1 on a document's first
        token; chat data), the last two uint8 or None."""
        self.parts.append(ids.astype(self.dtype))
        for held, side in ((self.masks, mask), (self.docs, doc)):
            if side is not None:
                held.append(np.asarray(side, np.uint8))
        self.held += len(ids)
        while self.held >= self.span:
            whole = np.concatenate(self.parts)
            masks, docs = (np.concatenate(h) if h else None for h in (self.masks, self.docs))
            self._write_span(whole[:self.span], *(None if a is None else a[:self.span] for a in (masks, docs)))
            self.parts, self.held = [whole[self.span:]], len(whole) - self.span
            self.masks, self.docs = ([] if a is None else [a[self.span:]] for a in (masks, docs))

    def close(self) -> None:
        if self.held:
            self._write_span(np.concatenate(self.parts), *(np.concatenate(h) if h else None
                                                          for h in (self.masks, self.docs)))
        self.parts, self.masks, self.docs, self.held = [], [], [], 0

    def _write_span(self, ids: np.ndarray, mask: np.ndarray | None, doc: np.ndarray | None = None) -> None:
        n_val = int(len(ids) * self.val_fraction)
        for split, cut in (("train", slice(0, len(ids) - n_val)), ("val", slice(len(ids) - n_val, len(ids)))):
            part = ids[cut]
            if not len(part):
                continue
            data = np.ascontiguousarray(part, dtype=self.dtype.newbyteorder("<")).tobytes()
            k = len(self.written[split])
            shards.write_atomic(self.out / shards.shard_name(split, k), data)
            entry = {"file": shards.shard_name(split, k), "tokens": int(len(part)),
                     "sha256": hashlib.sha256(data).hexdigest()}
            if mask is not None:
                bits = np.ascontiguousarray(mask[cut], dtype=np.uint8).tobytes()
                shards.write_atomic(self.out / shards.mask_name(split, k), bits)
                entry.update(mask_file=shards.mask_name(split, k), mask_sha256=hashlib.sha256(bits).hexdigest())
            if doc is not None:
                bits = np.ascontiguousarray(doc[cut], dtype=np.uint8).tobytes()
                shards.write_atomic(self.out / shards.doc_name(split, k), bits)
                entry.update(doc_file=shards.doc_name(split, k), doc_sha256=hashlib.sha256(bits).hexdigest())
            self.written[split].append(entry)


def _leftovers(out: Path) -> list[Path]:
    names = ("train_*.bin", "val_*.bin", "train_*.mask", "val_*.mask", "train_*.doc", "val_*.doc", ".*.tmp",
             shards.TOKENIZER_FILE)
    return sorted(p for pattern in names for p in out.glob(pattern))


def prepare(corpus: str, tokenizer: str, out, val_fraction: float = 0.1,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, text_field: str = "text",
            vocab_size: int | None = None, progress: bool = True,
            log: Callable[[str], None] | None = None, chat=None) -> PrepareResult:
    """Tokenize ``corpus`` into the shards of the folder ``out``; returns meta.json's
    contents. ``tokenizer``: byte, char, bpe (with ``vocab_size``), gpt2 or a
    tokenizer.json path; or a model (a folder, a .gguf file) whose tokenizer and chat
    template ``chat`` holds (formats.hf.read_chat's ModelChat; the command line reads
    it). A chat corpus (chat.is_chat_corpus) is rendered with the template and written
    with its loss mask. A folder this call created is removed again when an error
    stops it before any file is written."""
    if chat is None and isinstance(tokenizer, str) and (tokenizer.lower().endswith(".gguf")
                                                        or os.path.isdir(tokenizer)):
        raise ValueError(f"--tokenizer {tokenizer} is a model: pass its tokenizer and chat template as "
                         "chat=jaxformer.formats.hf.read_chat(...) (`jaxformer prepare` does)")
    if not os.fspath(out):
        raise ValueError("--out is empty: name the folder to write")
    out = Path(out)
    corpus = os.fspath(corpus) if isinstance(corpus, os.PathLike) else corpus
    log = log or (lambda line: None)
    check_number("--val-fraction", val_fraction, low=0, high=1, high_open=True)
    check_int("--shard-tokens", shard_tokens)
    source = {"corpus": corpus, "tokenizer": tokenizer, "vocab_size": vocab_size,
              "text_field": text_field, "val_fraction": val_fraction, "shard_tokens": shard_tokens}
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if (out / shards.META_FILE).is_file():
        meta = shards.read_meta(out)
        if meta["source"] != source:
            raise ValueError(f"{out} already holds data prepared from {meta['source']}; choose another "
                             "folder (or delete it) to prepare different data")
        n = shards.verify(out, meta)
        log(f"{out} is already prepared ({n} shard{'' if n == 1 else 's'} verified against {shards.META_FILE}); nothing to do")
        result = PrepareResult(meta)
        result.done_before = True
        return result
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        return PrepareResult(_prepare_into(out, source, progress, log, chat))
    except BaseException:
        if created and not any(out.iterdir()):
            out.rmdir()  # a missing or empty corpus leaves no empty folder behind
        raise


def _prepare_into(out: Path, source: dict, progress: bool, log: Callable[[str], None], chat=None) -> dict:
    """prepare's work in the folder ``out``: the tokenizer, the shards, meta.json last."""
    corpus, text_field = source["corpus"], source["text_field"]
    stale = _leftovers(out)
    if stale:
        for path in stale:
            path.unlink()
        log(f"removed {len(stale)} file{'' if len(stale) == 1 else 's'} of an interrupted prepare in {out}; starting over")
    is_chat = chat_data.is_chat_corpus(corpus, text_field)
    if is_chat:
        chat_data.check_template(chat, source["tokenizer"])
    if chat is not None:
        tok = chat.tokenizer
    else:
        texts = (_text(p) for p in pieces(corpus, text_field))
        if source["tokenizer"] == "char":  # documents are joined with a newline: the vocabulary must hold it
            texts = itertools.chain(texts, ["\n"])
        tok = make_tokenizer(source["tokenizer"], vocab_size=source["vocab_size"], texts=texts)
    dtype = shards.token_dtype(tok.vocab_size)
    writer = ShardWriter(out, dtype, source["shard_tokens"], source["val_fraction"])
    write = _write_chat if is_chat else _write_text
    n_docs, n_bytes, extra = write(writer, tok, chat, corpus, text_field, progress)
    splits = {split: {"tokens": sum(s["tokens"] for s in writer.written[split]),
                      "shards": writer.written[split]} for split in shards.SPLITS}
    if not splits["train"]["tokens"]:
        raise ValueError(f"corpus {corpus!r} gave no training tokens ({n_docs} document"
                         f"{'' if n_docs == 1 else 's'}, {n_bytes} bytes of text)")
    tok_dict = tok.to_dict()
    tok_file = tok_dict["json"] if tok.kind == "hf" else json.dumps(tok_dict)
    shards.write_atomic(out / shards.TOKENIZER_FILE, tok_file.encode("utf-8"))
    meta = {"format": shards.FORMAT, "version": shards.VERSION, "dtype": dtype.name,
            "vocab_size": tok.vocab_size, "tokenizer": tok_dict, "tokenizer_file": shards.TOKENIZER_FILE,
            "source": source, "documents": n_docs, "bytes": n_bytes, "splits": splits, **extra}
    shards.write_atomic(out / shards.META_FILE, json.dumps(meta, indent=1).encode("utf-8"))
    n_shards = len(writer.written['train']) + len(writer.written['val'])
    what = "conversation" if is_chat else "document"
    log(f"{out}: {splits['train']['tokens']:,} train / {splits['val']['tokens']:,} validation "
        f"{dtype.name} tokens in {n_shards} shard{'' if n_shards == 1 else 's'}, "
        f"from {n_docs:,} {what}{'' if n_docs == 1 else 's'} ({n_bytes / 2**20:.1f} MiB); {tok.kind} tokenizer, vocab {tok.vocab_size}"
        + (f"; loss mask on {extra['chat']['assistant_tokens']:,} assistant tokens" if is_chat else ""))
    return meta


def _write_text(writer: ShardWriter, tok, chat, corpus: str, text_field: str, progress: bool):
    """The documents of a text corpus into ``writer``: (documents, bytes, {})."""
    n_docs = n_bytes = 0
    # the source opened, and its first piece read, before the bar shows: a dataset that
    # cannot be opened (no `datasets` package, offline) is one error, not a bar and an error
    stream = pieces(corpus, text_field)
    first = next(stream, None)
    with tqdm(total=total_bytes(corpus), unit="B", unit_scale=True, disable=not progress,
              desc="tokenizing", dynamic_ncols=True) as bar:
        def counted():
            nonlocal n_docs, n_bytes
            for piece in itertools.chain([] if first is None else [first], stream):
                n_docs += piece.new_doc
                n_bytes += _text_bytes(piece)
                yield piece
        for ids in encode_stream(tok, counted(), bar):
            writer.add(ids)
        writer.close()
    return n_docs, n_bytes, {}


def _write_chat(writer: ShardWriter, tok, chat, corpus: str, text_field: str, progress: bool):
    """The conversations of a chat corpus and their loss masks into ``writer``:
    (conversations, bytes of message text, {"mask": True, "chat": ...})."""
    counts = {"documents": 0, "bytes": 0, "assistant_tokens": 0}
    with tqdm(unit=" conversations", disable=not progress, desc="rendering", dynamic_ncols=True) as bar:
        for ids, mask in chat_data.chat_stream(chat, corpus, counts):
            writer.add(ids, mask, (np.arange(len(ids)) == 0).astype(np.uint8))  # one conversation: its start
            bar.update(counts["documents"] - bar.n)
        writer.close()
    extra = {"mask": True, "doc_starts": True,
             "chat": {"chat_template": chat.chat_template, "bos_token": chat.bos_token,
                      "eos_token": chat.eos_token, "stop_ids": [int(i) for i in chat.stop_ids],
                      "assistant_tokens": counts["assistant_tokens"]}}
    return counts["documents"], counts["bytes"], extra
