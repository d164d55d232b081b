"""Every small preset learns: a few hundred steps on the default corpus bring its
validation loss well below the unigram (byte-frequency) baseline of the same split.

A preset that only learns which bytes are common (the sunfish preset once sat at
the unigram loss for hundreds of steps) fails here. Shorter sequences and batches
than the recipes' keep it fast; the recipe's optimizer, schedule and model are kept.
"""

import numpy as np
import pytest

from jaxformer import data
from jaxformer.training.loop import train
from jaxformer.training.run_data import load_data
from jaxformer.training.settings import settings_for

STEPS = 200
MARGIN = 0.25  # nats per token below the unigram loss


def quick(preset: str):
    return settings_for(preset, steps=STEPS, batch_size=8, seq_len=16, eval_every=0, eval_batches=8,
                        log_every=STEPS, ckpt_every=0)


@pytest.fixture(scope="module")
def unigram():
    tokenizer, train_ids, val_ids, _ = load_data(quick("loopos"))
    return data.unigram_loss(train_ids, val_ids, tokenizer.vocab_size)


def test_unigram_loss_is_the_frequency_models_cross_entropy():
    loss = data.unigram_loss([0, 0, 1], [0, 1, 2], vocab_size=3)  # smoothed counts 3, 2, 1
    np.testing.assert_allclose(loss, -np.mean(np.log([3 / 6, 2 / 6, 1 / 6])), rtol=1e-12)
    with pytest.raises(ValueError, match="validation token"):
        data.unigram_loss([0], [], vocab_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["loopos", "sunfish", "cllm", "tiny"])
def test_preset_beats_the_unigram_baseline(preset, unigram, tmp_path):
    result = train(quick(preset), tmp_path / preset, progress=False)
    val = result.records[-1]["val_loss"]
    assert val < unigram - MARGIN, (
        f"{preset}: validation loss {val:.3f} after {STEPS} steps is not {MARGIN} below the "
        f"unigram baseline {unigram:.3f}")
