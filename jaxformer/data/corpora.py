"""Corpora: the bytes a run trains on, from the bundled English text, the standard
library's Python sources, a file or a folder, and the one-line description a run
prints of where they came from."""

from __future__ import annotations

import importlib.resources
import os
import sysconfig

from jaxformer.model.checks import check_int

DEFAULT_STDLIB_MAX_BYTES = None  # the stdlib is read whole (about 12 MiB); --max-corpus-bytes cuts it
CORPUS_NAMES = ("default", "stdlib")  # reserved specs; write "./default" for a file so named


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
      "stdlib"   the standard library's .py sources that are valid UTF-8, sorted by path,
                 concatenated (whole unless max_bytes says otherwise)
      a path     a file, or a folder: its regular files, recursively, sorted by relative
                 path, hidden ones skipped, a newline added after a file lacking one

    max_bytes caps the result (cut before, never inside, a UTF-8 character). ValueError
    naming the path when it does not exist, is empty, or a folder holds no files.
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"corpus spec must be a str or a path, got {type(spec).__name__}")
    if max_bytes is not None:
        max_bytes = check_int("max_bytes", max_bytes)
    spec = os.fspath(spec)
    if spec == "default":
        data = importlib.resources.files("jaxformer").joinpath("corpus/default.txt").read_bytes()
        return _cap(data, max_bytes)
    if spec == "stdlib":
        data = _concat(stdlib_files(), max_bytes, utf8_only=True)  # valid UTF-8: a char vocabulary fits
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
        for file in files:
            _refuse_records(file, spec)
        data = _concat(files, max_bytes)
        if not data:
            raise ValueError(f"corpus folder {spec!r} holds only empty files")
        return data
    if os.path.isfile(path):
        _refuse_records(path, spec)
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


# record files: their text sits in a field, which `jaxformer prepare` reads (data/sources.py)
RECORD_SUFFIXES = {".jsonl": "a JSONL file", ".parquet": "a Parquet file"}


def _refuse_records(path: str, spec: str) -> None:
    """ValueError for a JSONL or Parquet file among a corpus's text files: read as bytes it
    would train on the file's syntax, not on its text field."""
    kind = RECORD_SUFFIXES.get(os.path.splitext(path)[1])
    if kind:
        where = repr(spec) if os.path.samefile(path, os.path.expanduser(spec)) else f"{spec!r} ({path})"
        raise ValueError(f"corpus {where} is {kind}: --corpus reads text files as they are; tokenize "
                         f"its text field once with `jaxformer prepare --corpus {spec} --out DIR`, "
                         f"then train with --data DIR")


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
        where = f"{spec} ({len(files)} file{'' if len(files) == 1 else 's'})" if os.path.isdir(path) else spec
        total = sum(os.path.getsize(f) for f in files)
    if max_bytes is None or total <= max_bytes:
        return f"{where}: {_size(n_read)}"
    return f"{where}: {_size(n_read)} read of {_size(total)} (capped at {_size(max_bytes)}: --max-corpus-bytes)"
