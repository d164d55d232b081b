"""Host-side data: tokenizers, corpora, split and batching (numpy only, fast)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxformer.data import (Batcher, ByteTokenizer, CharTokenizer, load_corpus, make_tokenizer,
                            sequential_batches, split_train_val, tokenizer_from_dict)
from jaxformer.data.batching import random_batch
from jaxformer.model.config import ModelConfig
from jaxformer.model.validate import validate_ids

# ----------------------------------------------------------------------------
# tokenizers


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_byte_tokenizer_round_trips_any_bytes(data):
    tok = ByteTokenizer()
    ids = tok.encode(data)
    assert ids.dtype == np.int32 and ids.shape == (len(data),)
    assert tok.decode_bytes(ids) == data


def test_byte_tokenizer_invalid_utf8():
    tok = ByteTokenizer()
    data = b"ok \xff\xfe \xc3 end \xe2\x82\xac"  # stray bytes, a cut sequence, a euro sign
    ids = tok.encode(data)
    assert ids.tolist() == list(data)
    assert tok.decode_bytes(ids) == data
    assert tok.decode(ids) == data.decode("utf-8", errors="replace")
    assert tok.decode(ids).endswith("end \u20ac")


def test_byte_tokenizer_str_is_utf8():
    tok = ByteTokenizer()
    assert tok.encode("h\u00e9").tolist() == [104, 0xC3, 0xA9]
    assert tok.decode(tok.encode("na\u00efve \u2603")) == "na\u00efve \u2603"
    assert tok.encode("").shape == (0,) and tok.decode([]) == ""


def test_byte_tokenizer_decode_rejects_out_of_range():
    with pytest.raises(ValueError, match="id 256 at position 1"):
        ByteTokenizer().decode([65, 256])
    with pytest.raises(ValueError, match="id -1"):
        ByteTokenizer().decode_bytes(np.array([-1]))


def test_char_tokenizer_round_trip():
    text = "hello, world!\nHELLO\tagain: caf\u00e9 \u2603"
    tok = CharTokenizer.from_text(text)
    assert tok.vocab_size == len(set(text))
    assert list(tok.chars) == sorted(set(text))
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.shape == (len(text),)
    assert ids.min() >= 0 and ids.max() < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.encode(text.encode("utf-8")).tolist() == ids.tolist()  # bytes are read as UTF-8


@settings(max_examples=50, deadline=None)
@given(st.text(min_size=1, max_size=200))
def test_char_tokenizer_round_trips_any_text(text):
    tok = CharTokenizer.from_text(text)
    assert tok.decode(tok.encode(text)) == text


def test_char_tokenizer_unknown_character():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"unknown character 'z' at index 4"):
        tok.encode("abcaz")
    with pytest.raises(ValueError, match=r"'\\n' at index 1"):
        tok.encode("a\nb")
    with pytest.raises(ValueError, match="at index 0"):
        tok.encode("\U0001F600")  # above every code point of the vocabulary


def test_char_tokenizer_decode_rejects_out_of_range():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"id 3 at position 2, outside \[0, vocab_size=3\)"):
        tok.decode([0, 1, 3])


def test_char_tokenizer_rejects_invalid_utf8_and_empty():
    with pytest.raises(ValueError, match="not valid UTF-8"):
        CharTokenizer.from_text(b"abc\xff")
    with pytest.raises(ValueError, match="empty"):
        CharTokenizer.from_text("")


@pytest.mark.parametrize("tok", [ByteTokenizer(), CharTokenizer.from_text("the quick fox \u00e9\n")])
def test_tokenizer_dict_round_trip(tok):
    d = json.loads(json.dumps(tok.to_dict()))  # JSON-serializable
    back = tokenizer_from_dict(d)
    assert type(back) is type(tok) and back == tok
    assert back.vocab_size == tok.vocab_size
    text = "the fox"
    assert back.encode(text).tolist() == tok.encode(text).tolist()


def test_char_tokenizer_from_dict_keeps_the_given_order():
    tok = tokenizer_from_dict({"kind": "char", "chars": ["b", "a"]})
    assert tok.encode("ab").tolist() == [1, 0]
    assert tok.decode([0, 1]) == "ba"


@pytest.mark.parametrize("d, match", [
    ({"kind": "bpe"}, "unknown tokenizer kind 'bpe'"),
    ({}, "unknown tokenizer kind None"),
    ({"kind": "char"}, "chars"),
    ({"kind": "char", "chars": ["a", "a"]}, "more than once"),
    ({"kind": "char", "chars": ["ab"]}, "single character"),
    ({"kind": "char", "chars": ["a", "b"], "vocab_size": 3}, "vocab_size"),
    ({"kind": "byte", "vocab_size": 255}, "vocab_size"),
])
def test_tokenizer_from_dict_rejects_malformed(d, match):
    with pytest.raises(ValueError, match=match):
        tokenizer_from_dict(d)
    with pytest.raises(ValueError):
        tokenizer_from_dict("byte")  # not a dict


def test_make_tokenizer():
    corpus = b"abcabc\n"
    assert make_tokenizer("byte", corpus) == ByteTokenizer()
    tok = make_tokenizer("char", corpus)
    assert isinstance(tok, CharTokenizer) and tok.vocab_size == 4
    with pytest.raises(ValueError, match="unknown tokenizer kind 'word'"):
        make_tokenizer("word", corpus)


# ----------------------------------------------------------------------------
# corpora


def test_default_corpus():
    data = load_corpus("default")
    assert isinstance(data, bytes) and len(data) > 30_000
    text = data.decode("ascii")  # plain ASCII English
    assert "attention" in text and "gradient" in text
    tok = make_tokenizer("char", data)
    assert tok.decode(tok.encode(data)) == text
    assert load_corpus("default", max_bytes=100) == data[:100]


def test_stdlib_corpus_is_capped_and_deterministic():
    data = load_corpus("stdlib", max_bytes=200_000)
    assert len(data) <= 200_000 and len(data) > 190_000
    assert b"def " in data and b"import " in data
    data.decode("utf-8")  # valid UTF-8, so a char vocabulary fits it
    assert load_corpus("stdlib", max_bytes=200_000) == data
    assert load_corpus("stdlib", max_bytes=1000) == data[:1000]


def test_corpus_file(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"some text\xff without a final newline")
    assert load_corpus(str(path)) == path.read_bytes()  # a file is read exactly
    assert load_corpus(path) == path.read_bytes()  # a Path works too
    assert load_corpus(str(path), max_bytes=4) == b"some"


def test_corpus_cap_does_not_split_a_character(tmp_path):
    path = tmp_path / "u.txt"
    path.write_bytes("ab\u20accd".encode("utf-8"))  # the euro sign is 3 bytes: 2, 3, 4
    assert load_corpus(str(path), max_bytes=3) == b"ab"
    assert load_corpus(str(path), max_bytes=4) == b"ab"
    assert load_corpus(str(path), max_bytes=5) == "ab\u20ac".encode("utf-8")


def test_corpus_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "b.txt").write_bytes(b"bee\n")
    (tmp_path / "a.txt").write_bytes(b"ay")  # no final newline: one is added
    (tmp_path / "sub" / "c.txt").write_bytes(b"sea\n")
    (tmp_path / ".secret").write_bytes(b"skip me\n")
    (tmp_path / ".hidden" / "d.txt").write_bytes(b"skip me too\n")
    (tmp_path / "empty.txt").write_bytes(b"")
    assert load_corpus(str(tmp_path)) == b"ay\nbee\nsea\n"
    assert load_corpus(str(tmp_path), max_bytes=5) == b"ay\nbe"


@pytest.mark.parametrize("spec", ["", "no/such/file.txt"])
def test_corpus_missing_path(tmp_path, spec):
    spec = spec and str(tmp_path / spec)
    with pytest.raises(ValueError) as e:
        load_corpus(spec)
    if spec:
        assert spec in str(e.value) and "does not exist" in str(e.value)


def test_corpus_empty_file_and_folder(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.txt.* is empty"):
        load_corpus(str(empty))
    folder = tmp_path / "nothing"
    folder.mkdir()
    (folder / ".hidden").write_text("x")
    with pytest.raises(ValueError, match=r"nothing.* holds no files"):
        load_corpus(str(folder))
    with pytest.raises(ValueError, match="max_bytes"):
        load_corpus("default", max_bytes=0)


# ----------------------------------------------------------------------------
# split


def test_split_is_deterministic_and_takes_the_end():
    ids = np.arange(1000, dtype=np.int32)
    train, val = split_train_val(ids, 0.1)
    assert len(train) == 900 and len(val) == 100
    np.testing.assert_array_equal(np.concatenate([train, val]), ids)
    assert val[0] == 900
    train2, val2 = split_train_val(ids, 0.1)
    np.testing.assert_array_equal(train, train2)
    np.testing.assert_array_equal(val, val2)
    train0, val0 = split_train_val(ids, 0.0)
    assert len(train0) == 1000 and len(val0) == 0


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 1.5, float("nan"), "0.1"])
def test_split_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(np.arange(10), fraction)


# ----------------------------------------------------------------------------
# batching


def _corpus(n=1000, vocab=50, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, size=n).astype(np.int32)


def test_batch_shapes_dtypes_and_shift():
    ids = np.arange(1000, dtype=np.int32)  # the value of a token is its position
    b = Batcher(ids, batch_size=4, seq_len=8, seed=0)
    batch = b.batch(0)
    assert set(batch) == {"inputs", "targets"}
    for key in ("inputs", "targets"):
        assert batch[key].dtype == np.int32 and batch[key].shape == (4, 8)
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)  # consecutive tokens


def test_batch_is_a_pure_function_of_seed_and_index():
    ids = _corpus()
    a = Batcher(ids, 4, 8, seed=3)
    b = Batcher(ids, 4, 8, seed=3)
    for index in [0, 1, 5, 200, 31, 0]:  # any order, fresh or reused instances
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(a.batch(index)[key], b.batch(index)[key])
    assert not np.array_equal(a.batch(0)["inputs"], a.batch(1)["inputs"])
    c = Batcher(ids, 4, 8, seed=4)
    assert not np.array_equal(a.batch(0)["inputs"], c.batch(0)["inputs"])
    d = Batcher(ids, 4, 8, seed=3)  # resume at a later index: same batch
    np.testing.assert_array_equal(d.batch(57)["inputs"], a.batch(57)["inputs"])


def test_epoch_covers_every_window_once():
    n, t, bsz = 1001, 10, 8
    ids = np.arange(n, dtype=np.int32)
    b = Batcher(ids, batch_size=bsz, seq_len=t, seed=1)
    assert b.n_windows == (n - 1) // t == 100
    assert b.batches_per_epoch == 100 // bsz == 12
    for epoch in range(3):
        first = np.concatenate([
            b.batch(epoch * b.batches_per_epoch + k)["inputs"][:, 0]
            for k in range(b.batches_per_epoch)
        ])
        assert len(np.unique(first)) == len(first) == b.batches_per_epoch * bsz  # no repeats
        np.testing.assert_array_equal(np.sort(b.epoch_starts(epoch)), np.arange(100) * t)
        assert set(first) <= set(b.epoch_starts(epoch).tolist())
    orders = [b.epoch_starts(e).tolist() for e in range(3)]
    assert orders[0] != orders[1] != orders[2]  # reshuffled each epoch


def test_epoch_grid_offset_stays_inside_the_corpus():
    n, t = 1000, 64  # 15 windows of 65 tokens, 39 tokens of slack
    ids = np.arange(n, dtype=np.int32)
    b = Batcher(ids, batch_size=3, seq_len=t, seed=0)
    offsets = set()
    for epoch in range(20):
        starts = np.sort(b.epoch_starts(epoch))
        assert len(starts) == b.n_windows == 15
        np.testing.assert_array_equal(np.diff(starts), t)  # non-overlapping, stride T
        assert starts[0] <= b.slack and starts[-1] + t + 1 <= n
        offsets.add(int(starts[0]))
        batch = b.batch(epoch * b.batches_per_epoch)
        assert batch["targets"].max() < n
    assert len(offsets) > 1


def test_fewer_windows_than_batch_size_repeats_windows_evenly():
    ids = np.arange(31, dtype=np.int32)  # 3 windows of seq_len 10
    b = Batcher(ids, batch_size=8, seq_len=10, seed=0)
    assert b.n_windows == 3 and b.batches_per_epoch == 1
    batch = b.batch(0)
    assert batch["inputs"].shape == (8, 10)
    starts, counts = np.unique(batch["inputs"][:, 0], return_counts=True)
    np.testing.assert_array_equal(starts, [0, 10, 20])  # every window is in
    assert sorted(counts.tolist()) == [2, 3, 3]  # floor or ceil of 8 / 3
    orders = {tuple(b.batch(epoch)["inputs"][:, 0]) for epoch in range(10)}
    assert len(orders) > 1  # each epoch reshuffles


def test_exactly_one_window():
    ids = np.arange(9, dtype=np.int32)
    b = Batcher(ids, batch_size=2, seq_len=8, seed=0)
    batch = b.batch(7)
    np.testing.assert_array_equal(batch["inputs"], [np.arange(8)] * 2)
    np.testing.assert_array_equal(batch["targets"], [np.arange(1, 9)] * 2)


def test_too_short_corpus():
    with pytest.raises(ValueError, match=r"corpus too short: 8 tokens, need at least seq_len \+ 1 = 9"):
        Batcher(np.arange(8), batch_size=2, seq_len=8, seed=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=0), "batch_size"),
    (dict(seq_len=-1), "seq_len"),
    (dict(seq_len=2.0), "seq_len"),
    (dict(seed=-1), "seed"),
])
def test_batcher_rejects_bad_sizes(kwargs, match):
    args = dict(batch_size=2, seq_len=4, seed=0) | kwargs
    with pytest.raises(ValueError, match=match):
        Batcher(np.arange(100), **args)
    with pytest.raises(ValueError, match="index"):
        Batcher(np.arange(100), 2, 4, 0).batch(-1)


def test_batch_ids_in_range_on_the_default_corpus():
    data = load_corpus("default")
    tok = make_tokenizer("char", data)
    train, val = split_train_val(tok.encode(data), 0.1)
    b = Batcher(train, batch_size=16, seq_len=64, seed=0)
    for index in range(0, 3 * b.batches_per_epoch, 7):
        batch = b.batch(index)
        validate_ids(batch["inputs"], tok.vocab_size)
        validate_ids(batch["targets"], tok.vocab_size)
    assert len(list(sequential_batches(val, 16, 64))) >= 1


def test_sequential_batches_are_in_order():
    ids = np.arange(101, dtype=np.int32)
    batches = list(sequential_batches(ids, batch_size=3, seq_len=10))
    assert len(batches) == 3  # 10 windows: 3 full batches, the 10th window left out
    firsts = np.concatenate([b["inputs"][:, 0] for b in batches])
    np.testing.assert_array_equal(firsts, np.arange(9) * 10)
    assert len(list(sequential_batches(ids, 3, 10, max_batches=2))) == 2
    (small,) = sequential_batches(np.arange(25), batch_size=8, seq_len=10)
    assert small["inputs"].shape == (2, 10)


# ----------------------------------------------------------------------------
# validate_ids


def test_validate_ids_names_the_id_and_position():
    validate_ids(np.array([0, 1, 9]), 10)
    with pytest.raises(ValueError, match=r"ids holds token id 10 at position 2, outside \[0, vocab_size=10\)"):
        validate_ids(np.array([0, 1, 10, 11]), 10)
    with pytest.raises(ValueError, match=r"inputs holds token id -3 at position \(1, 0\)"):
        validate_ids(np.array([[0, 1], [-3, 2]]), 10, name="inputs")
    with pytest.raises(ValueError, match="integers"):
        validate_ids(np.array([0.5]), 10)


def test_random_batch_is_shifted_in_range_and_fixed_by_its_seed():
    config = ModelConfig(vocab_size=7)
    batch = random_batch(config, 3, 5, seed=2)
    tokens = np.random.default_rng(2).integers(0, 7, size=(3, 6), dtype=np.int32)  # its definition
    np.testing.assert_array_equal(batch["inputs"], tokens[:, :-1])
    np.testing.assert_array_equal(batch["targets"], tokens[:, 1:])
    assert batch["inputs"].dtype == np.int32 and batch["inputs"].shape == (3, 5)
    assert not np.array_equal(random_batch(config, 3, 5, seed=3)["inputs"], batch["inputs"])
    with pytest.raises(ValueError, match="seq_len must be a positive integer, got 0"):
        random_batch(config, 3, 0)
