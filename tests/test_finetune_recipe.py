"""A fine-tune recipe you can see (training/recipes.py, data/packing.py, training/samples.py):
conversations packed whole into rows, --epochs counted in rows, --mix's rows placed by the
seed, the settings block naming where each value came from, and greedy replies to held-out
prompts at each evaluation. One small LoRA run over test_gguf's tiny GGUF chat model."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from helpers import one_line_error
from jaxformer.cli.main import main
from jaxformer.data import packing

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")


# --- packing, epochs and mixing: numpy only --------------------------------------------------

def _split(lengths):
    """A split of conversations of ``lengths`` tokens: ids 100 * k + position, docs at starts,
    the mask on each conversation's second half."""
    ids, mask, docs = [], [], []
    for k, n in enumerate(lengths):
        ids += [100 * k + i for i in range(n)]
        mask += [0] * (n // 2) + [1] * (n - n // 2)
        docs += [1] + [0] * (n - 1)
    return np.array(ids), np.array(mask), np.array(docs)


def test_pack_keeps_conversations_whole_and_numbers_them():
    lengths = [5, 9, 3, 4, 12, 2]
    ids, mask, docs = _split(lengths)
    p = packing.pack(ids, mask, docs, seq_len=8)  # rows of 9 tokens
    assert p.conversations == 6 and p.cut == 1 and p.longest == 12
    assert p.tokens.shape[1] == 9 and len(p.tokens) == 4  # 9 | 9 (12 cut) | 5 + 4 | 3 + 2
    seen = {}
    for row, seg, m in zip(p.tokens, p.segments, p.mask):
        for s in np.unique(seg):
            part = row[seg == s]
            if m[seg == s].any():
                k = int(part[0]) // 100
                np.testing.assert_array_equal(part, 100 * k + np.arange(len(part)))  # whole, in order
                seen[k] = len(part)
        assert (np.diff(seg) >= 0).all()
    assert seen == {0: 5, 1: 9, 2: 3, 3: 4, 4: 9, 5: 2}
    batch = packing.rows_batch(p, np.arange(4))
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    assert set(batch) == {"inputs", "targets", "mask", "segments"} and batch["inputs"].shape == (4, 8)


def test_epochs_see_each_row_as_often_and_batches_are_pure():
    ids, mask, docs = _split([3] * 10)
    p = packing.pack(ids, mask, docs, seq_len=5)  # two conversations a row: 5 rows
    b = packing.RowBatcher(p, batch_size=2, seed=3)
    steps = packing.steps_for_epochs(4, b.n_rows, 2)
    assert steps == 10
    rows = np.concatenate([b.batch(k)["inputs"] for k in range(steps)])
    firsts = [tuple(r) for r in rows]
    assert all(firsts.count(r) == 4 for r in set(firsts)) and len(set(firsts)) == 5
    np.testing.assert_array_equal(b.batch(7)["inputs"], packing.RowBatcher(p, 2, 3).batch(7)["inputs"])
    assert not np.array_equal(b.batch(0)["inputs"], packing.RowBatcher(p, 2, 4).batch(0)["inputs"])
    part = b.batch(3, rows=[1])
    np.testing.assert_array_equal(part["inputs"][1], b.batch(3)["inputs"][1])
    assert not part["inputs"][0].any()


def test_mix_places_an_exact_fraction_by_the_seed_and_reads_every_main_row():
    ids, mask, docs = _split([3] * 12)
    main_rows = packing.RowBatcher(packing.pack(ids, mask, docs, 5), 4, seed=0)  # 6 rows
    other_ids, other_mask, other_docs = _split([6] * 8)
    other = packing.RowBatcher(packing.pack(other_ids + 5000, other_mask, other_docs, 5), 4, seed=0)
    mixed = packing.MixedBatcher(main_rows, other, 0.25, seed=0)
    steps = packing.steps_for_epochs(2, main_rows.n_rows, 4, 0.25)
    assert steps == 4  # 12 main rows at 3 a step
    batches = [mixed.batch(k) for k in range(steps)]
    from_other = [int((b["inputs"][:, 0] >= 5000).sum()) for b in batches]
    assert sum(from_other) == 4 and all(n == 1 for n in from_other)  # 25% of 16 rows, one a batch
    ours = [tuple(r) for b in batches for r in b["inputs"] if r[0] < 5000]
    assert len(ours) == 12 and all(ours.count(r) == 2 for r in set(ours))  # every main row twice
    again = packing.MixedBatcher(main_rows, other, 0.25, seed=0).batch(2)
    np.testing.assert_array_equal(again["inputs"], batches[2]["inputs"])  # resumable: pure of (seed, k)
    placed = [packing.MixedBatcher(main_rows, other, 0.25, seed=s).placed(0) for s in range(6)]
    assert len({tuple(p) for p in placed}) > 1


@pytest.mark.parametrize("spec, message", [
    ("data/web", "write DATA:WEIGHT"),
    ("data/web:1.5", "the weight must be in (0, 1), got 1.5"),
    ("data/web:0", "the weight must be in (0, 1), got 0"),
    ("data/web:lots", "the weight 'lots' is not a number"),
])
def test_a_bad_mix_is_named(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        packing.parse_mix(spec)


# --- the command line -------------------------------------------------------------------------

QUESTION, ANSWER = "where did the cat sit?", "On the mat."


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """(GGUF file, a chat data folder of 20 conversations, a text data folder): one tokenizer."""
    from test_gguf import tiny_hf_tensors, tiny_tokenizer_meta, write_tiny
    d = tmp_path_factory.mktemp("recipe")
    model = write_tiny(d / "tiny.gguf", tiny_hf_tensors(), add_meta=tiny_tokenizer_meta)
    chats = d / "chats.jsonl"
    lines = [{"prompt": QUESTION, "completion": ANSWER}, {"prompt": "the dog?", "completion": "The park."}]
    chats.write_text("".join(json.dumps(lines[k % 2]) + "\n" for k in range(20)))
    text = d / "text.txt"
    text.write_text("the cat sat on the mat. the dog ran to the park!\n" * 30)
    for corpus, out in ((chats, "chats"), (text, "text")):
        assert main(["prepare", "--corpus", str(corpus), "--tokenizer", str(model), "--out", str(d / out),
                     "--no-progress", "--val-fraction", "0.2"]) == 0
    return model, d / "chats", d / "text"


def test_lora_recipe_epochs_mix_and_replies(chat_model, tmp_path, capsys):
    """--init-from with --lora-rank and --epochs over chat data, --mix of text: every value says
    where it came from, the steps come from the packed rows, and each evaluation prints greedy
    replies to the validation split's prompts, which the metrics record keeps."""
    model, chats, text = chat_model
    capsys.readouterr()
    run = tmp_path / "run"
    assert main(["train", "--init-from", str(model), "--data", str(chats), "--lora-rank", "4",
                 "--epochs", "2", "--batch-size", "4", "--mix", f"{text}:0.25", "--eval-samples", "2",
                 "--out", str(run), "--no-progress", "--ignore-memory-check"]) == 0
    err = capsys.readouterr().err
    lines = err.splitlines()

    def line(name):
        found = [ln for ln in lines if ln.split()[:1] == [name]]
        assert found, (name, err)
        return found[0]

    assert line("lr").split()[1:] == ["0.0002", "(recipe", "lora)"]
    assert line("optimizer").endswith("(recipe lora)") and line("schedule").endswith("(recipe lora)")
    assert line("lora_rank").endswith("(flag)") and line("epochs").endswith("(flag)")
    assert line("packing").split()[1:3] == ["conversations", "(recipe"]
    assert "(data: longest conversation" in line("seq_len")
    assert line("eval_samples").endswith("(flag)") and "(recipe lora: 5 in the run)" in line("eval_every")
    data_note = next(ln for ln in lines if ln.strip().startswith("data: ") and "conversations" in ln)
    import re
    found = re.search(r"(\d+) conversations in (\d+) rows of (\d+) tokens", data_note)
    assert found and "75% of each batch" in data_note, data_note
    conversations, rows, width = map(int, found.groups())
    assert conversations >= 16 and width == int(line("seq_len").split()[1]) + 1
    assert f"2 epochs = {packing.steps_for_epochs(2, rows, 4, 0.25)} steps" in data_note
    records = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    steps = int(line("steps").split()[1])
    assert records[-1]["step"] == steps and f"{steps} steps" in data_note
    evaluated = [r for r in records if "val_loss" in r]
    assert evaluated and all(len(r["samples"]) == 2 for r in evaluated)
    prompts = [x["prompt"] for x in evaluated[-1]["samples"]]
    assert any(QUESTION in p for p in prompts) and all(p.endswith("<|im_start|>assistant\n") for p in prompts)
    assert any(ln.startswith(f"step {steps}: val loss ") and "greedy replies to 2 held-out" in ln for ln in lines)
    # the loop's own block is short: no dump of every field, no note about a preset's recipe
    assert line("model").startswith("model    the initial params") and "config.toml" in line("model")
    assert line("grads").startswith("grads    manual") and line("devices")
    assert "vocab_size=" not in err and "recipe's" not in err and "note:" not in err


@pytest.mark.parametrize("flags", [[], ["--batch-size", "8"]])
def test_a_small_chat_folder_gets_a_batch_of_at_least_ten_steps_an_epoch(chat_model, flags, tmp_path):
    """The lora recipe's 8 rows a step over a folder of ~16 rows made 2 steps an epoch: the
    recipe's batch shrinks to rows // 10 (at least 1), saying why; a batch the user gave stays."""
    from jaxformer.cli.main import build_parser
    from jaxformer.cli.train import resolve_settings
    from jaxformer.training import recipes
    model, chats, _ = chat_model
    args = build_parser().parse_args(["train", "--init-from", str(model), "--data", str(chats), "--lora-rank", "4",
                                      "--epochs", "2", *flags, "--out", str(tmp_path / "r")])
    settings, sources = resolve_settings(args)
    assert settings.batch_size == 8
    sized = recipes.size_to_run(settings, sources, "lora", 64)
    rows = int(re.search(r"in (\d+) rows", sources.notes[-1]).group(1))
    batch = 8 if flags else max(1, rows // recipes.MIN_STEPS_PER_EPOCH)
    assert rows < 8 * recipes.MIN_STEPS_PER_EPOCH and sized.batch_size == batch
    assert sized.steps == packing.steps_for_epochs(2, rows, batch, 0.0) >= (2 * recipes.MIN_STEPS_PER_EPOCH
                                                                            if not flags else 1)
    assert sources.get("batch_size") == ("flag" if flags else
                                         f"recipe lora: {rows} rows, at least 10 steps an epoch")


def test_runs_not_from_a_model_keep_their_preset_recipe(tmp_path):
    """Without --init-from the preset's recipe and the defaults are today's; the sources say so."""
    from jaxformer.cli.main import build_parser
    from jaxformer.cli.train import resolve_settings
    from jaxformer.training.settings import settings_for
    args = build_parser().parse_args(["train", "--preset", "loopos", "--lr", "0.01", "--out", str(tmp_path / "r")])
    settings, sources = resolve_settings(args)
    assert settings == settings_for("loopos", lr=0.01)
    assert sources.get("lr") == "flag" and sources.get("seq_len") == "preset loopos"
    assert sources.get("seed") == "default" and settings.packing == "windows" and settings.eval_samples == 0


@pytest.mark.parametrize("extra, message", [
    (["--corpus", "CORPUS", "--epochs", "2"], "epochs needs a prepared --data folder"),
    (["--data", "CHATS", "--epochs", "2", "--steps", "5"], "give --epochs or --steps, not both"),
    (["--data", "CHATS", "--steps", "2", "--mix", "TEXT:1.5"], "the weight must be in (0, 1), got 1.5"),
    (["--data", "CHATS", "--steps", "2", "--mix", "nowhere-xyz:0.5"], "data folder nowhere-xyz does not exist"),
])
def test_bad_fine_tune_options_are_one_line(chat_model, extra, message, tmp_path, capsys):
    model, chats, text = chat_model
    extra = [{"CHATS": str(chats), "CORPUS": str(tmp_path / "c.txt")}.get(a, a.replace("TEXT", str(text)))
             for a in extra]
    (tmp_path / "c.txt").write_text("hello there\n" * 50)
    code = main(["train", "--init-from", str(model), "--lora-rank", "2", *extra, "--out", str(tmp_path / "run"),
                 "--no-progress"])
    assert message in one_line_error(capsys, code)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_cached_greedy_replies_are_the_forwards_argmax(positions):
    """samples.greedy (a prefill over the key/value cache, then cached steps) picks at each
    position the argmax of the plain forward over the prompt and the reply so far."""
    import jax
    import jax.numpy as jnp

    import jaxformer
    from jaxformer.training import samples
    config = jaxformer.ModelConfig(vocab_size=32, d_model=16, n_heads=2, n_layers=2, d_ff=24, max_seq_len=128,
                                   positions=positions)
    params = jaxformer.init_params(jax.random.PRNGKey(3), config, dtype=jnp.float32)
    prompt = np.arange(1, 8, dtype=np.int32)
    window = np.zeros((1, 64), np.int32)
    window[0, :len(prompt)] = prompt
    new = np.asarray(samples.greedy(params, jnp.asarray(window), jnp.int32(len(prompt)),
                                    config.replace(max_seq_len=64), 20))
    ids = np.concatenate([prompt, new[:-1]])[None]
    want = np.asarray(jaxformer.forward(params, jnp.asarray(ids), config))[0, len(prompt) - 1:].argmax(-1)
    np.testing.assert_array_equal(new, want)
    assert len(set(new.tolist())) > 1  # not one token repeated: the steps read the cache
