"""The data of a training run: its corpus read and tokenized, split into training and
validation tokens, and served as batches (the data room's pieces, put together as
the run's settings say)."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable, NamedTuple


import numpy as np

from jaxformer import data
from jaxformer.data import packing
from jaxformer.checkpoints import checkpoint
from jaxformer.formats.hf import gguf_has_tokenizer, is_gguf, read_chat
from jaxformer.observe import report
from jaxformer.training.resume import check_data, data_fingerprint, prepared_fingerprint
from jaxformer.training.settings import TrainSettings


class RunData(NamedTuple):
    tokenizer: Any  # a data.Tokenizer (byte, char or hf)
    batcher: data.Batcher  # training batches, a pure function of (seed, index)
    val_batches: list  # host batches {"inputs": (B, T), "targets": (B, T)}; [] without validation
    fingerprint: dict  # resume.data_fingerprint of the corpus and tokenizer


def load_data(settings: TrainSettings, tokenizer=None, check: Callable[[dict], None] | None = None,
              log=None) -> tuple[Any, Any, Any, dict]:
    """(tokenizer, train ids, val ids, fingerprint); a given tokenizer (a resumed run's)
    is kept. ``check(fingerprint)`` runs before the corpus is encoded; ``log``: a
    function given the lines that describe the data. With ``settings.data`` the ids are
    the prepared folder's memory-mapped shards (data.ShardedTokens), never read whole."""
    if settings.data:
        return load_prepared(settings, tokenizer, check, log)
    corpus = data.load_corpus(settings.corpus, max_bytes=settings.max_corpus_bytes)
    try:
        if tokenizer is None:
            tokenizer = make_tokenizer(settings, corpus)
        fingerprint = data_fingerprint(corpus, tokenizer)
        if check is not None:
            check(fingerprint)
        ids = tokenizer.encode(corpus)
    except ValueError as e:
        if "UTF-8" not in str(e):
            raise
        raise ValueError(f"corpus {settings.corpus}: {e}") from None
    train_ids, val_ids = data.split_train_val(ids, settings.val_fraction)
    if log:
        source = data.describe_corpus(settings.corpus, settings.max_corpus_bytes, len(corpus))
        for line in report.data_lines(source, tokenizer, len(train_ids), len(val_ids)):
            log(line)
    return tokenizer, train_ids, val_ids, fingerprint


def model_tokenizer(source) -> str | None:
    """The ``--tokenizer`` that is a model's own: a GGUF file with a tokenizer in its
    metadata (the file itself), a model folder's tokenizer.json; None when it has none."""
    if is_gguf(source):
        return os.path.abspath(source) if gguf_has_tokenizer(source) else None
    own = os.path.join(source, "tokenizer.json")
    return os.path.abspath(own) if os.path.isfile(own) else None


def make_tokenizer(settings: TrainSettings, corpus: bytes):
    """The tokenizer ``settings.tokenizer`` names (a .gguf file: the one its metadata
    holds); a bpe learns its merges from the training part of the corpus only (the bytes
    before the validation tail)."""
    if isinstance(settings.tokenizer, str) and is_gguf(settings.tokenizer):
        return read_chat(settings.tokenizer).tokenizer
    if settings.tokenizer != "bpe":
        return data.make_tokenizer(settings.tokenizer, corpus, vocab_size=settings.vocab_size)
    try:
        text = corpus.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not valid UTF-8 at byte {e.start}; use --tokenizer byte for such files") from None
    train_text = text[:len(text) - int(len(text) * settings.val_fraction)]
    return data.make_tokenizer("bpe", vocab_size=settings.vocab_size, texts=[train_text])


def load_prepared(settings: TrainSettings, tokenizer=None, check=None, log=None):
    """load_data of a prepared folder: meta.json read and the shard sizes checked (the
    digests were checked when it was prepared; the fingerprint is made of them)."""
    meta = data.read_meta(settings.data)
    data.check_sizes(settings.data, meta)
    own = data.tokenizer_from_dict(meta["tokenizer"])
    fingerprint = prepared_fingerprint(meta, own)
    if check is not None:
        check(fingerprint)
    tokenizer = tokenizer or own
    if tokenizer.vocab_size != meta["vocab_size"]:
        raise ValueError(f"the tokenizer's vocabulary ({tokenizer.vocab_size}) does not match the "
                         f"{meta['vocab_size']} of {settings.data}/meta.json")
    train_ids = data.open_split(settings.data, meta, "train")
    val_ids = data.open_split(settings.data, meta, "val")
    if log:
        source = (f"{settings.data} (prepared from {meta['source']['corpus']}: "
                  f"{len(meta['splits']['train']['shards']) + len(meta['splits']['val']['shards'])} "
                  f"{meta['dtype']} shards, memory-mapped)")
        for line in report.data_lines(source, tokenizer, len(train_ids), len(val_ids)):
            log(line)
    return tokenizer, train_ids, val_ids, fingerprint


def check_vocab(settings: TrainSettings, tokenizer) -> None:
    """A model vocabulary set by hand (a config file's vocab_size) must be the tokenizer's."""
    want = settings.model.get("vocab_size") if isinstance(settings.model, dict) else None
    if want is not None and want != tokenizer.vocab_size:
        where = settings.data or settings.corpus
        raise ValueError(f"the model's vocab_size {want} does not match the {tokenizer.kind} "
                         f"tokenizer's vocabulary of {tokenizer.vocab_size} ({where})")


def run_data(settings: TrainSettings, run_dir: Path, saved_meta: dict | None = None,
             allow_change: bool = False, log=None) -> RunData:
    """The run's tokenizer and batches. A resumed run (``saved_meta``: the meta of the
    checkpoint it resumes) keeps its tokenizer and refuses a changed corpus or
    tokenizer (resume.check_data) unless ``allow_change``."""
    tokenizer, check = None, None
    if saved_meta is not None:
        tokenizer = data.tokenizer_from_dict(saved_meta["tokenizer"])
        check = functools.partial(check_data, saved_meta.get("data"),
                                  where=checkpoint.checkpoint_dir(run_dir), allow_change=allow_change)
    tokenizer, train_ids, val_ids, fingerprint = load_data(settings, tokenizer, check, log)
    check_vocab(settings, tokenizer)
    if settings.packing == "conversations":
        batcher, val_batches = packed_data(settings, train_ids, val_ids)
    else:
        batcher, val_batches = window_data(settings, train_ids, val_ids)
    if settings.mix:
        batcher = mixed_in(settings, tokenizer, batcher, log)
    return RunData(tokenizer, batcher, val_batches, fingerprint)


def window_data(settings: TrainSettings, train_ids, val_ids):
    """(Batcher of T + 1-token windows, validation batches) of a token stream."""
    if settings.packed_documents:
        data.batching.check_doc_starts(train_ids)
    try:
        batcher = data.Batcher(train_ids, settings.batch_size, settings.seq_len, settings.seed,
                               segments=settings.packed_documents)
    except ValueError as e:
        where = settings.data or settings.corpus
        raise ValueError(f"the training split of {where} is too small for one batch: {e}") from None
    val_batches = []
    if len(val_ids) > settings.seq_len:
        val_batches = list(data.sequential_batches(
            val_ids, settings.batch_size, settings.seq_len, settings.eval_batches,
            segments=settings.packed_documents))
    return batcher, val_batches


def packed_data(settings: TrainSettings, train_ids, val_ids):
    """(RowBatcher of whole conversations packed into rows, validation batches: the validation
    split packed alike) of a chat data folder (packing.py)."""
    if getattr(train_ids, "docs", None) is None:
        raise ValueError(f"packing conversations needs a chat data folder (`jaxformer prepare` of a chat "
                         f"JSONL file); {settings.data} holds no conversation starts (--packing windows)")
    train = packing.pack(np.asarray(train_ids), _host(train_ids.mask), np.asarray(train_ids.docs),
                         settings.seq_len)
    val_batches = []
    if len(val_ids) and getattr(val_ids, "docs", None) is not None:
        val = packing.pack(np.asarray(val_ids), _host(val_ids.mask), np.asarray(val_ids.docs), settings.seq_len)
        val_batches = packing.packed_val_batches(val, settings.batch_size, settings.eval_batches)
    return packing.RowBatcher(train, settings.batch_size, settings.seed), val_batches


def _host(mask):
    return None if mask is None else np.asarray(mask)


def mixed_in(settings: TrainSettings, tokenizer, batcher, log=None):
    """``batcher`` with the rows of --mix's data folder in a fraction of each batch (packing.py);
    its tokenizer must be the run's."""
    folder, weight = packing.parse_mix(settings.mix)
    meta = data.read_meta(folder)
    data.check_sizes(folder, meta)
    theirs = data.tokenizer_from_dict(meta["tokenizer"])
    if theirs.to_dict() != tokenizer.to_dict():
        raise ValueError(f"--mix {settings.mix}: {folder} was prepared with another tokenizer "
                         f"({theirs.kind}, vocab {theirs.vocab_size}) than the run's ({tokenizer.kind}, "
                         f"vocab {tokenizer.vocab_size}); prepare it with the run's --tokenizer")
    ids = data.open_split(folder, meta, "train")
    if meta.get("doc_starts"):
        other = packing.RowBatcher(packing.pack(np.asarray(ids), _host(ids.mask), np.asarray(ids.docs),
                                                settings.seq_len), settings.batch_size, settings.seed)
    else:
        other = packing.WindowRows(data.Batcher(ids, settings.batch_size, settings.seq_len, settings.seed))
    main = batcher if hasattr(batcher, "rows_at") else packing.WindowRows(batcher)
    if log:
        log(f"mix      {folder}: {weight:.0%} of each batch's rows ({ids.__len__():,} train tokens)")
    return packing.MixedBatcher(main, other, weight, settings.seed)
