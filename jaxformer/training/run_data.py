"""The data of a training run: its corpus read and tokenized, split into training and
validation tokens, and served as batches (the data room's pieces, put together as
the run's settings say)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

from jaxformer import data
from jaxformer.checkpoints import checkpoint
from jaxformer.observe import report
from jaxformer.training.resume import check_data, data_fingerprint
from jaxformer.training.settings import TrainSettings


class RunData(NamedTuple):
    tokenizer: Any  # data.ByteTokenizer or data.CharTokenizer
    batcher: data.Batcher  # training batches, a pure function of (seed, index)
    val_batches: list  # host batches {"inputs": (B, T), "targets": (B, T)}; [] without validation
    fingerprint: dict  # resume.data_fingerprint of the corpus and tokenizer


def load_data(settings: TrainSettings, tokenizer=None, check: Callable[[dict], None] | None = None,
              log=None) -> tuple[Any, np.ndarray, np.ndarray, dict]:
    """(tokenizer, train ids, val ids, fingerprint); a given tokenizer (a resumed run's)
    is kept. ``check(fingerprint)`` runs before the corpus is encoded; ``log``: a
    function given the lines that describe the data."""
    corpus = data.load_corpus(settings.corpus, max_bytes=settings.max_corpus_bytes)
    if tokenizer is None:
        tokenizer = data.make_tokenizer(settings.tokenizer, corpus)
    fingerprint = data_fingerprint(corpus, tokenizer)
    if check is not None:
        check(fingerprint)
    ids = tokenizer.encode(corpus)
    train_ids, val_ids = data.split_train_val(ids, settings.val_fraction)
    if log:
        source = data.describe_corpus(settings.corpus, settings.max_corpus_bytes, len(corpus))
        for line in report.data_lines(source, tokenizer, len(train_ids), len(val_ids)):
            log(line)
    return tokenizer, train_ids, val_ids, fingerprint


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
    batcher = data.Batcher(train_ids, settings.batch_size, settings.seq_len, settings.seed)
    val_batches = []
    if len(val_ids) > settings.seq_len:
        val_batches = list(data.sequential_batches(
            val_ids, settings.batch_size, settings.seq_len, settings.eval_batches))
    return RunData(tokenizer, batcher, val_batches, fingerprint)
