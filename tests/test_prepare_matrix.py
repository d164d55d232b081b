"""jaxformer prepare over every source kind x every tokenizer kind, each folder read
back the way `train --data` reads it (run_data: the memory-mapped shards, a batch,
the validation batches, the folder's tokenizer), the token stream decoded to the
documents it came from; and prepare's bad input, each a one-line error."""

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxformer import data
from jaxformer.cli.main import main
from jaxformer.data.hf_tokenizers import gpt2_candidates
from jaxformer.data.prepare import prepare
from jaxformer.data.sources import text_file_pieces
from jaxformer.training.run_data import run_data
from jaxformer.training.settings import settings_for

ROOT = Path(__file__).resolve().parents[1]
EOT = "<|endoftext|>"  # the end-of-text token of the bpe, json and gpt2 tokenizers
# Non-ASCII text (a str's length is not its UTF-8 size), documents with and without a last newline.
DOCS = [
    "The quick brown fox jumps over the lazy dog.\n",
    "Über den Wolken: café, naïve, résumé — 東京",
    "two lines\nof text without an end",
    "a cat sat on the mat, then on the hat\n",
    "a fox 🦊, a tab\tand \"quotes\"\n",
    "the last one, again without a newline",
]
SOURCES = ["text", "folder", "jsonl", "parquet", "hf"]
TOKENIZERS = ["byte", "char", "bpe", "gpt2", "json", "own-json"]
B, T, SHARD = 2, 8, 64  # a batch of (B, T); spans of 64 tokens: several shards of each split


def _with_newline(doc):
    return doc if doc.endswith("\n") else doc + "\n"


def write_source(kind, root, monkeypatch):
    """(corpus spec, the documents as prepare reads them) of a source of ``kind`` holding DOCS."""
    if kind == "text":  # one document; its missing last newline is added
        path = root / "corpus.txt"
        path.write_text("".join(map(_with_newline, DOCS)).rstrip("\n"), encoding="utf-8")
        return str(path), ["".join(map(_with_newline, DOCS))]
    if kind == "folder":  # a document a file, read in the order of their relative paths
        for i, doc in enumerate(DOCS):
            path = root / "docs" / ("sub" if i >= 4 else "") / f"{i:02d}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(doc, encoding="utf-8")
        (root / "docs" / ".hidden.txt").write_text("skipped")
        return str(root / "docs"), [_with_newline(d) for d in DOCS]
    if kind == "jsonl":
        path = root / "docs.jsonl"
        path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(DOCS)) + "\n")
        return str(path), DOCS
    if kind == "parquet":
        pq.write_table(pa.table({"id": list(range(len(DOCS))), "text": DOCS}), root / "docs.parquet")
        return str(root / "docs.parquet"), DOCS
    assert kind == "hf"  # a stand-in for the `datasets` package: nothing downloaded

    def load_dataset(name, config, split, streaming):
        assert (name, config, split, streaming) == ("tiny", None, "train", True)
        return iter([{"text": d} for d in DOCS])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return "hf:tiny", DOCS


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    """A tokenizers file (a byte-level BPE trained on other text) and the package's own
    tokenizer.json (a prepared folder's, here a char vocabulary covering DOCS)."""
    root = tmp_path_factory.mktemp("tokenizers")
    bpe = data.make_tokenizer("bpe", vocab_size=280, texts=["the lazy dog sat on a mat\n" * 20])
    bpe.tokenizer.save(str(root / "bpe.json"))
    own = data.CharTokenizer.from_texts([*DOCS, "\n"])
    (root / "own.json").write_text(json.dumps(own.to_dict()))
    return {"json": str(root / "bpe.json"), "own-json": str(root / "own.json")}


def tokenizer_spec(kind, files):
    """(prepare's tokenizer argument, its vocab_size argument)."""
    if kind == "bpe":
        return "bpe", 300
    if kind == "gpt2":
        if not any(os.path.isfile(p) for p in gpt2_candidates()):
            pytest.skip("GPT-2's tokenizer.json is not on this machine (JAXFORMER_GPT2_TOKENIZER)")
        return "gpt2", None
    return files.get(kind, kind), None


def expected_stream(docs, eot):
    """The documents as prepare joins them: by the end-of-text token, else by a newline
    where the previous document does not end with one."""
    if eot:
        return eot.join(docs)
    return "".join(d if i == 0 or docs[i - 1].endswith("\n") else "\n" + d for i, d in enumerate(docs))


def token_stream(out, meta):
    """Every token in stream order: span k is train shard k then val shard k."""
    def read(split):
        return [np.fromfile(out / s["file"], dtype=np.dtype(meta["dtype"]).newbyteorder("<"))
                for s in meta["splits"][split]["shards"]]
    train, val = read("train"), read("val")
    parts = [p for k in range(len(train)) for p in (train[k], *val[k:k + 1])]
    return np.concatenate(parts)


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
@pytest.mark.parametrize("source", SOURCES)
def test_prepared_folder_is_read_by_train_data(source, tokenizer, tmp_path, monkeypatch, tokenizer_files):
    corpus, docs = write_source(source, tmp_path, monkeypatch)
    spec, vocab_size = tokenizer_spec(tokenizer, tokenizer_files)
    out = tmp_path / "data"
    meta = prepare(corpus, spec, out, val_fraction=0.2, shard_tokens=SHARD, vocab_size=vocab_size,
                   progress=False)
    assert meta["documents"] == len(docs)
    assert meta["bytes"] == sum(len(d.encode("utf-8")) for d in docs)  # UTF-8 bytes, not characters
    assert len(meta["splits"]["train"]["shards"]) > 1 and meta["dtype"] == "uint16"

    settings = settings_for("tiny", data=str(out), batch_size=B, seq_len=T, eval_batches=2)
    run = run_data(settings, tmp_path / "run")  # what `train --data` does before its first step
    tok = run.tokenizer
    assert tok == data.load_tokenizer_file(str(out / "tokenizer.json"))
    assert tok.vocab_size == meta["vocab_size"]
    for batch in (run.batcher.batch(0), run.batcher.batch(3), *run.val_batches):
        for ids in (batch["inputs"], batch["targets"]):
            assert ids.dtype == np.int32 and ids.shape[1] == T
            assert 0 <= ids.min() and ids.max() < tok.vocab_size
        np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert run.batcher.batch(0)["inputs"].shape == (B, T) and run.val_batches

    ids = token_stream(out, meta)
    assert len(ids) == meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
    eot = EOT if getattr(tok, "eot_id", None) is not None else None
    assert tok.decode(ids) == expected_stream(docs, eot)  # every tokenizer here is lossless on DOCS


def test_train_data_command_takes_a_step_on_prepared_jsonl(tmp_path):
    """The real command line: `prepare` a JSONL file with the byte tokenizer, then
    `train --data` in a subprocess for one step."""
    corpus, _ = write_source("jsonl", tmp_path, None)
    assert main(["prepare", "--corpus", corpus, "--tokenizer", "byte", "--out", str(tmp_path / "d"),
                 "--no-progress"]) == 0
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "jaxformer", "train", "--preset", "tiny", "--data", str(tmp_path / "d"),
         "--steps", "1", "--batch-size", str(B), "--seq-len", str(T), "--out", str(tmp_path / "run"),
         "--no-progress"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1] and np.isfinite(records[-1]["loss"])


# ------------------------------------------------------------------ bad input: one line each


def _one_line_error(capsys, argv):
    code = main(["prepare", "--no-progress", *map(str, argv)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize("records, message", [
    ("", r"corpus '.*docs.jsonl' gave no training tokens \(0 documents, 0 bytes of text\)"),
    ('{"text": ""}\n', r"gave no training tokens \(1 document, 0 bytes of text\)"),
    ('{"body": "a"}\n', r"docs.jsonl:1: the record has no field 'text' \(its fields: body\)"),
    ('{"text": "ok"}\n{"text": "a\\ud800b"}\n',
     r"docs.jsonl:2: field 'text' holds '\\ud800' at character 1, half of a UTF-16 surrogate pair"),
])
@pytest.mark.parametrize("tokenizer", ["byte", "char"])
def test_bad_jsonl_is_one_line_and_leaves_no_folder(records, message, tokenizer, tmp_path, capsys):
    (tmp_path / "docs.jsonl").write_text(records)
    err = _one_line_error(capsys, ["--corpus", tmp_path / "docs.jsonl", "--tokenizer", tokenizer,
                                   "--out", tmp_path / "d"])
    assert re.search(message, err), err
    assert not (tmp_path / "d").exists()


def test_bad_paths_are_one_line(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("hello\n")
    (tmp_path / "fake.parquet").write_text("not parquet")
    os.mkfifo(tmp_path / "pipe")
    cases = [
        (["--corpus", tmp_path / "none.jsonl", "--out", tmp_path / "d"], "none.jsonl' does not exist"),
        (["--corpus", tmp_path / "pipe", "--out", tmp_path / "d"], "pipe' is neither a file nor a folder"),
        (["--corpus", tmp_path / "fake.parquet", "--out", tmp_path / "d"],
         "fake.parquet: not a Parquet file ("),
        (["--corpus", tmp_path / "t.txt", "--out", tmp_path / "t.txt"], "t.txt is a file, not a folder"),
        (["--corpus", tmp_path / "t.txt", "--out", ""], "--out is empty"),
    ]
    for argv, message in cases:
        assert message in _one_line_error(capsys, [*argv, "--tokenizer", "byte"])
        assert not (tmp_path / "d").exists()


def test_a_fixed_char_vocabulary_names_the_file_of_an_unknown_character(tmp_path, tokenizer_files, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(DOCS[0])
    (tmp_path / "docs" / "b.txt").write_text("an unseen ✓\n")
    err = _one_line_error(capsys, ["--corpus", tmp_path / "docs", "--tokenizer", tokenizer_files["own-json"],
                                   "--out", tmp_path / "d"])
    assert f"error: {tmp_path / 'docs' / 'b.txt'}: unknown character '✓' at index 10" in err, err


def test_corpus_as_a_path_and_the_log_line(tmp_path):
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": DOCS[1]}) + "\n")
    lines = []
    meta = prepare(tmp_path / "docs.jsonl", "byte", tmp_path / "d", progress=False, log=lines.append)
    assert meta["source"]["corpus"] == str(tmp_path / "docs.jsonl") and meta["bytes"] == len(DOCS[1].encode())
    assert "from 1 document (0.0 MiB); byte tokenizer, vocab 256" in lines[-1]


@pytest.mark.parametrize("body", ["no newline at all", "ends in a character: 東京", "one\ntwo", "one\n"])
@pytest.mark.parametrize("chunk_bytes", [3, 1 << 20])
def test_a_text_file_without_a_last_newline_gets_one(body, chunk_bytes, tmp_path):
    """As load_corpus reads a folder: a file's last line kept apart from the next file's,
    whether or not the file's last piece holds a newline."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "t.txt").write_text(body, encoding="utf-8")
    got = list(text_file_pieces(str(tmp_path / "docs" / "t.txt"), chunk_bytes=chunk_bytes))
    assert b"".join(p.data for p in got) == data.load_corpus(str(tmp_path / "docs")) == _with_newline(body).encode()
    assert all(p.data for p in got) and [p.new_doc for p in got] == [True] + [False] * (len(got) - 1)
