"""jaxformer prepare (token shards + meta.json), train --data over the memory-mapped
shards, the subword tokenizers, and the errors bad data input gets."""

import json
import random
import sys
import types

import chex
import numpy as np
import pytest

from jaxformer import data
from jaxformer.checkpoints import runs
from jaxformer.cli.main import main
from jaxformer.data.prepare import prepare
from jaxformer.data.sources import parse_hf_spec, pieces, text_file_pieces
from jaxformer.observe.metrics import RUN_KEYS, read_metrics
from jaxformer.training.loop import train
from jaxformer.training.settings import settings_for
from jaxformer.training.step import state_template

WORDS = "the quick brown fox jumps over a lazy dog while one small cat sat on the mat".split()


def text(n_lines=200, seed=0):
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(n_lines)) + "\n"


def run_prepare(corpus, tokenizer, out, **kw):
    return prepare(str(corpus), tokenizer, out, progress=False, **kw)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(text())
    return path


@pytest.mark.parametrize("kind", ["byte", "char"])
def test_prepare_text_equals_the_in_memory_split(text_file, tmp_path, kind):
    meta = run_prepare(text_file, kind, tmp_path / "d")
    corpus = data.load_corpus(str(text_file))
    ids = data.make_tokenizer(kind, corpus).encode(corpus)
    train_ids, val_ids = data.split_train_val(ids, 0.1)
    assert meta["dtype"] == "uint16" and meta["splits"]["train"]["tokens"] == len(train_ids)
    np.testing.assert_array_equal(np.asarray(data.open_split(tmp_path / "d", meta, "train")), train_ids)
    np.testing.assert_array_equal(np.asarray(data.open_split(tmp_path / "d", meta, "val")), val_ids)
    assert data.tokenizer_from_dict(meta["tokenizer"]) == data.make_tokenizer(kind, corpus)
    on_disk = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert on_disk == dict(meta) and on_disk["source"]["corpus"] == str(text_file)
    assert data.load_tokenizer_file(str(tmp_path / "d" / "tokenizer.json")) == data.make_tokenizer(kind, corpus)


def test_shards_split_every_span_and_the_memmap_batcher_equals_the_in_memory_one(text_file, tmp_path):
    meta = run_prepare(text_file, "byte", tmp_path / "d", shard_tokens=1000, val_fraction=0.0)
    train_shards = meta["splits"]["train"]["shards"]
    assert len(train_shards) > 3 and not meta["splits"]["val"]["shards"]
    ids = data.ByteTokenizer().encode(text_file.read_bytes())
    mapped = data.open_split(tmp_path / "d", meta, "train")
    assert isinstance(mapped.arrays[0], np.memmap)
    memory, sharded = data.Batcher(ids, 8, 37, seed=3), data.Batcher(mapped, 8, 37, seed=3)
    for index in (0, 1, 5, memory.batches_per_epoch + 2):  # windows across shard ends included
        chex.assert_trees_all_equal(sharded.batch(index), memory.batch(index))
    part = sharded.batch(4, rows=[1, 6])
    np.testing.assert_array_equal(part["inputs"][[1, 6]], memory.batch(4)["inputs"][[1, 6]])
    assert not part["inputs"][[0, 2, 3, 4, 5, 7]].any()
    val = run_prepare(text_file, "byte", tmp_path / "v", shard_tokens=1000, val_fraction=0.25)
    assert [s["tokens"] for s in val["splits"]["val"]["shards"][:2]] == [250, 250]


def test_prepare_jsonl_joins_documents_with_end_of_text(tmp_path):
    docs = [text(3, seed=i) for i in range(40)]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))
    meta = run_prepare(corpus, "bpe", tmp_path / "d", vocab_size=300, text_field="body", val_fraction=0.0)
    tok = data.tokenizer_from_dict(meta["tokenizer"])
    assert tok.kind == "hf" and tok.eot_id is not None and meta["documents"] == 40
    ids = np.asarray(data.open_split(tmp_path / "d", meta, "train"))
    assert (ids == tok.eot_id).sum() == 39
    assert tok.decode(ids) == "<|endoftext|>".join(docs)


def test_prepare_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = [text(2, seed=i) for i in range(10)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "docs.parquet")
    meta = run_prepare(tmp_path / "docs.parquet", "char", tmp_path / "d", val_fraction=0.0)
    tok = data.tokenizer_from_dict(meta["tokenizer"])
    assert tok.decode(np.asarray(data.open_split(tmp_path / "d", meta, "train"))) == "".join(docs)
    pq.write_table(pa.table({"body": docs}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match=r"other\.parquet: no column 'text' \(its columns: body\)"):
        run_prepare(tmp_path / "other.parquet", "char", tmp_path / "e")


def test_text_pieces_cut_after_newlines_and_never_inside_a_character(tmp_path):
    path = tmp_path / "t.txt"
    body = ("é" * 37 + "\n" + "ü" * 50) * 20
    path.write_text(body)
    got = list(text_file_pieces(str(path), chunk_bytes=16))
    assert b"".join(p.data for p in got).decode("utf-8") == body + "\n"
    assert [p.offset for p in got] == list(np.cumsum([0] + [len(p.data) for p in got[:-1]]))
    assert got[0].new_doc and not any(p.new_doc for p in got[1:])
    for p in got:
        p.data.decode("utf-8")  # every piece is whole characters


def test_atomic_rerun_is_a_no_op_and_an_interrupted_prepare_starts_over(text_file, tmp_path):
    out = tmp_path / "d"
    first = run_prepare(text_file, "byte", out, shard_tokens=2000)
    assert not list(out.glob(".*"))  # no temporary file left
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    lines = []
    again = prepare(str(text_file), "byte", out, shard_tokens=2000, progress=False, log=lines.append)
    assert again.done_before and dict(again) == dict(first)
    assert "already prepared" in lines[0] and "nothing to do" in lines[0]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    with pytest.raises(ValueError, match="already holds data prepared from"):
        run_prepare(text_file, "char", out, shard_tokens=2000)
    # an interrupted prepare: shards and a temporary file, no meta.json
    (out / "meta.json").unlink()
    (out / ".train_00009.bin.tmp").write_bytes(b"\0" * 10)
    lines = []
    redone = prepare(str(text_file), "byte", out, shard_tokens=2000, progress=False, log=lines.append)
    assert "interrupted prepare" in lines[0] and not redone.done_before
    assert redone["splits"] == first["splits"] and not list(out.glob(".*"))


# ------------------------------------------------------------------ bad input, one line each


def test_bad_shards_are_named(text_file, tmp_path):
    out = tmp_path / "d"
    run_prepare(text_file, "byte", out, shard_tokens=2000)
    shard = out / "train_00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[0] ^= 1
    shard.write_bytes(bytes(raw))  # same size, other bytes
    with pytest.raises(ValueError, match=r"shard .*train_00001\.bin does not match its sha256"):
        run_prepare(text_file, "byte", out, shard_tokens=2000)
    shard.write_bytes(bytes(raw[:-2]))
    with pytest.raises(ValueError, match=r"shard .*train_00001\.bin holds \d+ bytes but meta\.json says"):
        data.check_sizes(out, data.read_meta(out))
    with pytest.raises(ValueError, match=r"train_00001\.bin holds"):
        train(settings_for("tiny", data=str(out), steps=1), tmp_path / "run", progress=False)


def test_a_folder_without_meta_json(tmp_path):
    with pytest.raises(ValueError, match="holds no meta.json: not a prepared data folder"):
        train(settings_for("tiny", data=str(tmp_path), steps=1), tmp_path / "run", progress=False)


def test_missing_text_field_names_file_and_line(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"text": "a"}\n\n{"body": "b"}\n')
    with pytest.raises(ValueError, match=r"docs\.jsonl:3: the record has no field 'text' \(its fields: body\)"):
        run_prepare(corpus, "byte", tmp_path / "d")


def test_invalid_utf8_names_file_and_byte_offset(tmp_path):
    corpus = tmp_path / "bad.txt"
    corpus.write_bytes(b"fine text\n" * 5 + b"ab\xffcd\n")
    with pytest.raises(ValueError, match=r"bad\.txt is not valid UTF-8 at byte 52"):
        run_prepare(corpus, "char", tmp_path / "d")
    assert run_prepare(corpus, "byte", tmp_path / "b")["splits"]["train"]["tokens"] > 0
    with pytest.raises(ValueError, match=r"corpus .*bad\.txt: .*not valid UTF-8 \(byte 52"):
        train(settings_for("tiny", corpus=str(corpus), tokenizer="char", steps=1), tmp_path / "r",
              progress=False)


def test_too_small_for_one_batch_and_a_vocabulary_that_does_not_match(tmp_path):
    (tmp_path / "small.txt").write_text("tiny\n")
    run_prepare(tmp_path / "small.txt", "byte", tmp_path / "d")
    with pytest.raises(ValueError, match=r"training split of .*d is too small for one batch: .*5 tokens"):
        train(settings_for("tiny", data=str(tmp_path / "d"), steps=1), tmp_path / "r", progress=False)
    (tmp_path / "t.txt").write_text(text(20))
    run_prepare(tmp_path / "t.txt", "byte", tmp_path / "e")
    settings = settings_for("tiny", data=str(tmp_path / "e"), steps=1, model={"vocab_size": 300})
    with pytest.raises(ValueError, match="model's vocab_size 300 does not match the byte tokenizer's "
                                         "vocabulary of 256"):
        train(settings, tmp_path / "r2", progress=False)


def test_gpt2_without_its_files_says_how_to_provide_them(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXFORMER_GPT2_TOKENIZER", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="GPT-2's tokenizer.json is not on this machine: set "
                                         "JAXFORMER_GPT2_TOKENIZER"):
        data.make_tokenizer("gpt2")


def test_hf_dataset_specs(monkeypatch):
    assert parse_hf_spec("hf:wikitext:wikitext-2-raw-v1:validation") == (
        "wikitext", "wikitext-2-raw-v1", "validation")
    assert parse_hf_spec("hf:owt") == ("owt", None, "train")
    with pytest.raises(ValueError, match="write hf:NAME"):
        parse_hf_spec("hf:")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(ValueError, match=r"hf:owt: Hugging Face datasets need the `datasets` package"):
        next(pieces("hf:owt"))


def test_hf_datasets_are_streamed_and_offline_is_one_error(monkeypatch, tmp_path):
    """A stand-in for the `datasets` package (nothing downloaded): the records are
    streamed in order with the spec's name, config and split; prepare tokenizes them
    as documents; a missing field names its row; offline is one error naming the spec."""
    calls = []
    rows = [{"text": f"document {i} about cats and dogs. "} for i in range(30)]

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        if name == "offline":
            raise ConnectionError("Couldn't reach 'offline' on the Hub (LocalEntryNotFoundError)\nmore")
        return iter(rows if name == "good" else [{"text": "a"}, {"body": "b"}])

    monkeypatch.setitem(sys.modules, "datasets",
                        types.SimpleNamespace(load_dataset=load_dataset))
    got = list(pieces("hf:good:cfg:validation"))
    assert calls == [("good", "cfg", "validation", True)]
    assert [x.data for x in got] == [r["text"] for r in rows] and all(x.new_doc for x in got)
    assert [x.offset for x in got] == list(range(1, 31)) and got[0].where == "hf:good:cfg:validation"
    meta = run_prepare("hf:good", "char", tmp_path / "d", val_fraction=0.1)
    assert meta["documents"] == 30 and meta["source"]["corpus"] == "hf:good"
    with pytest.raises(ValueError, match=r"hf:missing row 2: the record has no field 'text' "
                                         r"\(its fields: body\); choose one with --text-field"):
        list(pieces("hf:missing"))
    with pytest.raises(ValueError) as e:
        next(pieces("hf:offline"))
    assert str(e.value).startswith("cannot open the Hugging Face dataset hf:offline (ConnectionError: "
                                   "Couldn't reach 'offline' on the Hub (LocalEntryNotFoundError))")
    assert "\n" not in str(e.value) and "must be online" in str(e.value)


# ------------------------------------------------------------------ tokenizers


def test_bpe_and_tokenizer_json_round_trip(tmp_path):
    tok = data.make_tokenizer("bpe", vocab_size=320, texts=[text(50)])
    sample = "the lazy cat jumps, über alles\n"
    assert tok.decode(tok.encode(sample)) == sample  # byte-level: lossless on unseen text
    assert data.tokenizer_from_dict(json.loads(json.dumps(tok.to_dict()))) == tok
    path = tmp_path / "tokenizer.json"
    tok.tokenizer.save(str(path))
    loaded = data.make_tokenizer(str(path))
    assert loaded.kind == "hf" and loaded.vocab_size == tok.vocab_size
    np.testing.assert_array_equal(loaded.encode(sample), tok.encode(sample))
    with pytest.raises(ValueError, match="needs --vocab-size"):
        data.make_tokenizer("bpe", texts=["abc"])
    with pytest.raises(ValueError, match="does not exist"):
        data.make_tokenizer(str(tmp_path / "none.json"))


def test_prefetcher_keeps_the_order_and_hands_on_errors():
    def make(i):
        if i == 5:
            raise ValueError("batch 5 is bad")
        return {"i": i}

    with data.Prefetcher(make, 2) as batches:
        assert [batches.next()["i"] for _ in range(3)] == [2, 3, 4]
        with pytest.raises(ValueError, match="batch 5 is bad"):
            batches.next()


# ------------------------------------------------------------------ train --data


def _losses(run_dir):
    return [{k: v for k, v in r.items() if k not in RUN_KEYS} for r in read_metrics(run_dir)]


def test_resume_from_data_is_bit_exact_and_the_run_keeps_its_tokenizer(tmp_path):
    (tmp_path / "t.txt").write_text(text(300))
    run_prepare(tmp_path / "t.txt", "bpe", tmp_path / "d", vocab_size=300, shard_tokens=900)

    def settings(steps):
        return settings_for("tiny", data=str(tmp_path / "d"), steps=steps, log_every=1, eval_every=2,
                            eval_batches=2, ckpt_every=0)

    full = train(settings(4), tmp_path / "straight", progress=False)
    train(settings(2), tmp_path / "resumed", progress=False)  # its last step is one of eval_every's
    again = train(settings(4), tmp_path / "resumed", resume=True, progress=False)
    assert [r["step"] for r in again.records] == [3, 4]
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")  # exactly, val_loss included
    chex.assert_trees_all_equal(again.state, full.state)
    _, config, tokenizer, _ = runs.load_state(tmp_path / "straight", state_template)
    assert tokenizer == data.load_tokenizer_file(str(tmp_path / "d" / "tokenizer.json"))
    assert config.vocab_size == tokenizer.vocab_size


@pytest.mark.parametrize("missing", ["datasets", "offline"])
def test_a_dataset_that_cannot_be_opened_is_refused_before_the_progress_bar(missing, monkeypatch,
                                                                            tmp_path, capsys):
    """`jaxformer prepare --corpus hf:...` without the `datasets` package (or offline): the
    one error line alone, no "tokenizing" bar drawn first, and no folder left behind."""
    def load_dataset(name, config, split, streaming):
        raise ConnectionError("Couldn't reach the Hub")

    fake = None if missing == "datasets" else types.SimpleNamespace(load_dataset=load_dataset)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    code = main(["prepare", "--corpus", "hf:wikitext:wikitext-103-raw-v1", "--tokenizer", "byte",
                 "--out", str(tmp_path / "d")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "tokenizing" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "hf:wikitext" in lines[0], err
    assert not (tmp_path / "d").exists()
