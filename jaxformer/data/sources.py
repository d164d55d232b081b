"""The documents of a corpus, streamed: what ``jaxformer prepare`` tokenizes.

A corpus spec is "default", "stdlib", a file or a folder (as ``load_corpus`` reads
them), or ``hf:NAME[:CONFIG][:SPLIT]`` (a Hugging Face dataset, streamed; needs the
``datasets`` package). In a file or folder, ``*.jsonl`` files hold one JSON record a
line and ``*.parquet`` files a table (needs ``pyarrow``), each record's text in the
field ``text_field``; any other file is text, one document.

Nothing is read whole: a text file comes in pieces of about ``CHUNK_BYTES``, cut
after a newline where the piece has one (else before a UTF-8 character, never inside
one), records one at a time. Each ``Piece`` says where it comes from (file and byte
offset, or file and line) and whether it starts a new document.
"""

from __future__ import annotations

import importlib.resources
import json
import os
from typing import Iterator, NamedTuple

from jaxformer.data.corpora import CORPUS_NAMES, _files_below, stdlib_files

CHUNK_BYTES = 1 << 20
HF_PREFIX = "hf:"


class Piece(NamedTuple):
    data: str | bytes  # bytes from a text file, str from a record
    where: str  # the file (or dataset) it comes from
    offset: int  # the byte offset of data in a text file; the line (1-based) or row of a record
    new_doc: bool  # the first piece of a document


def corpus_files(spec: str) -> list[str]:
    """The files of a file, folder or built-in spec, in reading order."""
    if spec == "default":
        return [str(importlib.resources.files("jaxformer").joinpath("corpus/default.txt"))]
    if spec == "stdlib":
        return stdlib_files()
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        files = _files_below(path)
        if not files:
            raise ValueError(f"corpus folder {spec!r} holds no files")
        return files
    if os.path.isfile(path):
        return [path]
    if os.path.exists(path):
        raise ValueError(f"corpus path {spec!r} is neither a file nor a folder")
    raise ValueError(f"corpus path {spec!r} does not exist (built-in corpora: {', '.join(CORPUS_NAMES)}; "
                     f"a Hugging Face dataset: hf:NAME[:CONFIG][:SPLIT])")


def total_bytes(spec: str) -> int | None:
    """The bytes a spec's files hold (for a progress bar); None for a dataset."""
    if spec.startswith(HF_PREFIX):
        return None
    return sum(os.path.getsize(f) for f in corpus_files(spec))


def pieces(spec: str, text_field: str = "text") -> Iterator[Piece]:
    """The pieces of a corpus, in order (see the module docstring)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError('corpus spec is empty; give "default", "stdlib", a path or hf:NAME')
    if spec.startswith(HF_PREFIX):
        yield from hf_records(spec, text_field)
        return
    for path in corpus_files(spec):
        if path.endswith(".jsonl"):
            yield from jsonl_records(path, text_field)
        elif path.endswith(".parquet"):
            yield from parquet_records(path, text_field)
        elif spec == "stdlib":
            with open(path, "rb") as f:
                data = f.read()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue  # as load_corpus("stdlib"): a char vocabulary fits the rest
            yield from _text_pieces(path, data, 0, True)
        else:
            yield from text_file_pieces(path)


def _text_pieces(path: str, data: bytes, offset: int, new_doc: bool) -> Iterator[Piece]:
    if data and not data.endswith(b"\n"):
        data += b"\n"  # as load_corpus: a file's last line kept apart from the next file's
    if data:
        yield Piece(data, path, offset, new_doc)


def _cut(data: bytes) -> int:
    """Where a piece of data ends: after its last newline, else before the UTF-8
    character it ends in (the character goes with the next piece), else at its end."""
    cut = data.rfind(b"\n") + 1
    if cut:
        return cut
    cut = len(data)
    while cut > len(data) - 4 and cut > 0 and (data[cut - 1] & 0xC0) == 0x80:
        cut -= 1  # data[cut - 1] continues a character: back up to its start
    if cut > 0 and data[cut - 1] >= 0xC0:
        cut -= 1  # the lead byte of a cut character goes with its continuation
    return cut or len(data)


def text_file_pieces(path: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Piece]:
    """A text file in pieces of about chunk_bytes, cut after a newline where the piece
    holds one, else before a UTF-8 character. A block is read ahead, so the last piece
    is known as the last: it gets the newline a file lacks."""
    offset, first = 0, True
    with open(path, "rb") as f:
        data = f.read(chunk_bytes)
        while True:
            block = f.read(chunk_bytes)
            if not block:
                yield from _text_pieces(path, data, offset, first)
                return
            cut = _cut(data)
            yield Piece(data[:cut], path, offset, first)
            offset, first = offset + cut, False
            data = data[cut:] + block


def _record_text(record, field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if field not in record:
        fields = ", ".join(sorted(map(str, record))[:8]) or "none"
        raise ValueError(f"{where}: the record has no field {field!r} (its fields: {fields}); "
                         "choose one with --text-field")
    text = record[field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {field!r} holds {type(text).__name__}, not text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON may escape half a surrogate pair: "\ud800"
        raise ValueError(f"{where}: field {field!r} holds {text[e.start]!r} at character {e.start}, "
                         "half of a UTF-16 surrogate pair: not text") from None
    return text


def jsonl_records(path: str, field: str) -> Iterator[Piece]:
    """One piece per non-blank line of a JSON-lines file: the line's ``field``."""
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}:{n}: not a JSON record ({e})") from None
            yield Piece(_record_text(record, field, f"{path}:{n}"), path, n, True)


def parquet_records(path: str, field: str) -> Iterator[Piece]:
    """One piece per row of a Parquet file: the column ``field``, read a batch at a time."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow: pip install 'jaxformer[data]'") from None
    try:
        pf = pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"{path}: not a Parquet file ({e})") from None
    columns = pf.schema_arrow.names
    if field not in columns:
        raise ValueError(f"{path}: no column {field!r} (its columns: {', '.join(columns[:8])}); "
                         "choose one with --text-field")
    row = 0
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            row += 1
            if not isinstance(text, str):
                raise ValueError(f"{path}: row {row}: column {field!r} holds {type(text).__name__}, not text")
            yield Piece(text, path, row, True)


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """hf:NAME[:CONFIG][:SPLIT] -> (name, config or None, split, default "train")."""
    parts = spec[len(HF_PREFIX):].split(":")
    if not parts[0] or len(parts) > 3:
        raise ValueError(f"bad dataset spec {spec!r}: write hf:NAME[:CONFIG][:SPLIT]")
    name, config, split = parts[0], (parts[1] if len(parts) > 1 and parts[1] else None), \
        (parts[2] if len(parts) > 2 and parts[2] else "train")
    return name, config, split


def hf_records(spec: str, field: str) -> Iterator[Piece]:
    """The records of a Hugging Face dataset, streamed (nothing is stored whole)."""
    name, config, split = parse_hf_spec(spec)
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{spec}: Hugging Face datasets need the `datasets` package: "
                         "pip install 'jaxformer[data]'") from None
    try:
        stream = datasets.load_dataset(name, config, split=split, streaming=True)
        records = iter(stream)
        first = next(records, None)
    except Exception as e:  # offline, unknown name, bad config: the library's many errors
        raise ValueError(f"cannot open the Hugging Face dataset {spec} ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}); it is streamed from the hub, "
                         "so the machine must be online (or the dataset cached)") from None
    if first is None:
        return
    yield Piece(_record_text(first, field, f"{spec} row 1"), spec, 1, True)
    for n, record in enumerate(records, 2):
        yield Piece(_record_text(record, field, f"{spec} row {n}"), spec, n, True)
