"""The unigram baseline: the validation loss of a model that ignores context and
predicts each token by its frequency in the training split.

A language model that does not beat it has learned nothing beyond which tokens are
common; a preset's run should be well below it within a few hundred steps.
"""

from __future__ import annotations

import numpy as np


def unigram_loss(train_ids, val_ids, vocab_size: int) -> float:
    """Mean cross entropy (nats per token) of ``val_ids`` under the token frequencies
    of ``train_ids``, add-one smoothed over ``vocab_size`` ids so an id the training
    split lacks costs a finite amount."""
    train_ids, val_ids = np.asarray(train_ids).ravel(), np.asarray(val_ids).ravel()
    if val_ids.size == 0:
        raise ValueError("unigram_loss needs at least one validation token")
    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts) - np.log(counts.sum())
    return float(-log_p[val_ids].mean())
