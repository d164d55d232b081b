"""Packed chat data: `prepare` records each conversation's first token beside the shards (the
.doc files), the batcher numbers each row's conversations (batch["segments"]) when asked, and
a run with packed_documents trains with both gradient sources to the same losses."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tiny_settings
from test_chat_data import CONVERSATIONS, chat, model_folder, prepared  # noqa: F401  (fixtures)

from jaxformer import data


def test_prepare_marks_each_conversations_start(prepared, chat):  # noqa: F811
    meta = data.read_meta(prepared)
    assert meta["doc_starts"] is True
    assert all("doc_file" in s for split in ("train", "val") for s in meta["splits"][split]["shards"])
    data.verify(prepared)  # the .doc files' digests too
    train, val = data.open_split(prepared, meta, "train"), data.open_split(prepared, meta, "val")
    ids = np.concatenate([np.asarray(train), np.asarray(val)])
    docs = np.concatenate([np.asarray(train.docs), np.asarray(val.docs)])
    assert docs.sum() == meta["documents"] == 3 * 8
    eot = chat.tokenizer.tokenizer.token_to_id("<|endoftext|>")
    np.testing.assert_array_equal(np.nonzero(docs)[0][1:], np.nonzero(ids == eot)[0])  # each opened by the eot
    assert docs[0] == 1


def test_batches_number_the_conversations_of_each_row(prepared):  # noqa: F811
    meta = data.read_meta(prepared)
    train = data.open_split(prepared, meta, "train")
    batcher = data.Batcher(train, batch_size=4, seq_len=48, seed=0, segments=True)
    batch = batcher.batch(1)
    starts = train.docs.rows(batcher.batch_starts(1), 48)
    starts[:, 0] = 0
    np.testing.assert_array_equal(batch["segments"], np.cumsum(starts, axis=1))
    assert batch["segments"].max() >= 1 and (np.diff(batch["segments"], axis=1) >= 0).all()
    part = batcher.batch(1, rows=[2])
    np.testing.assert_array_equal(part["segments"][2], batch["segments"][2])
    assert "segments" not in data.Batcher(train, 4, 48, 0).batch(1)
    val = list(data.sequential_batches(data.open_split(prepared, meta, "val"), 2, 16, segments=True))
    assert all("segments" in b for b in val)
    with pytest.raises(ValueError, match="packed_documents needs the document starts"):
        data.Batcher(np.arange(100), 2, 8, 0, segments=True)


def test_packed_chat_run_trains_alike_with_both_sources(prepared, tmp_path):  # noqa: F811
    """packed_documents: the batches carry segments, the segments change the loss over whole
    rows (the chat mask may keep only answers before a row's first start), and a run
    with manual gradients has the losses of one with jax.grad."""
    import jax

    from jaxformer.model.transformer import loss_fn
    from jaxformer.training.loop import prepare_run, run_steps
    losses = {}
    for grads in ("auto", "manual"):
        settings = tiny_settings("default", data=str(prepared), steps=3, batch_size=4, seq_len=16,
                                 eval_every=0, packed_documents=True, grads=grads)
        run = prepare_run(settings, tmp_path / grads, check_memory=False)
        batch = max((run.data.batcher.batch(i) for i in range(3)), key=lambda b: b["segments"].max())
        assert batch["segments"].max() >= 1
        params = jax.device_get(run.state.params)
        whole = {k: v for k, v in batch.items() if k != "mask"}  # every target: the answers may sit before a start
        unpacked = {k: v for k, v in whole.items() if k != "segments"}
        assert abs(float(loss_fn(params, whole, run.config)) - float(loss_fn(params, unpacked, run.config))) > 1e-5
        _, log = run_steps(run, progress=False)
        losses[grads] = [r["loss"] for r in log.records]
    assert len(losses["auto"]) == 3
    np.testing.assert_allclose(losses["manual"], losses["auto"], rtol=2e-5)
