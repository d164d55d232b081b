"""`generate --run --chat` over a LoRA run of an imported GGUF base (its template and stop ids
from the base, its adapters merged), the stream stopping at a stop id, and the lines generate
writes on stderr (what it loads and compiles, one timing line) on every path."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers import one_line_error
from jaxformer.checkpoints import checkpoint
from jaxformer.cli.main import main
from jaxformer.data.chat import render_chat
from jaxformer.formats.hf import read_chat, read_hf
from jaxformer.inference.stream import stream_tokens
from jaxformer.model.lora import LoraConfig, init_adapters, merge
from jaxformer.training.optim import make_optimizer
from jaxformer.training.settings import TrainSettings
from jaxformer.training.step import init_state

test_gguf = pytest.importorskip("test_gguf")  # its tiny Llama GGUF writer (needs the gguf package)
TINY = test_gguf.TINY  # D 32, 2 layers, vocab 64, max_seq_len 64, rotary
QUESTION = "where did the cat sit?"
N = 12  # new tokens at most


def write_base(path, extra=None):
    test_gguf.write_tiny(path, test_gguf.tiny_hf_tensors(), extra=extra, add_meta=test_gguf.tiny_tokenizer_meta)
    return str(path)


def write_lora_run(run, base: str) -> dict:
    """A LoRA run's folder over ``base`` as train writes it (the adapters its checkpoint,
    settings naming the base), adapters with B != 0; returns the merged params."""
    chat = read_chat(base)
    params = read_hf(base, np.float32)[0]
    settings = TrainSettings(tokenizer=base, seq_len=16, lora_rank=2, lora_alpha=4.0,
                             lora_targets="q,v,down", lora_base=base)
    lora = settings.lora()
    adapters = init_adapters(jax.random.PRNGKey(1), params, lora)
    rng = np.random.default_rng(2)
    adapters = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.5 * rng.standard_normal(x.shape).astype(x.dtype) if p[-1].key == "b" else x,
        adapters)
    meta = {"config": TINY.to_dict(), "tokenizer": chat.tokenizer.to_dict(), "settings": settings.to_dict(),
            "param_dtype": "float32"}
    checkpoint.save(run, init_state(adapters, make_optimizer(**settings.optimizer_kwargs())), meta)
    return merge(params, adapters, LoraConfig(lora.rank, lora.alpha, 0.0, lora.targets))


def greedy(params, chat, text, stop_ids=()):
    return list(stream_tokens(params, TINY, chat.tokenizer.encode(text), N, stop_ids=stop_ids))


def test_run_chat_over_a_lora_run_of_a_gguf_base_stops_at_end_of_turn(tmp_path, capsys):
    """The base's head is changed so that <|im_end|> outscores the token the adapted model
    would say third: the reply ends there, so it was the base's stop ids that ended it."""
    plain = write_base(tmp_path / "plain.gguf")
    chat = read_chat(plain)
    prompt = render_chat(chat, [{"role": "user", "content": QUESTION}])
    merged = write_lora_run(tmp_path / "probe", plain)
    said = greedy(merged, chat, prompt)  # the adapted model of the plain base, no stops
    end = chat.tokenizer.tokenizer.token_to_id("<|im_end|>")
    cut = next(i for i in range(2, N) if said[i] not in said[:i])  # the first new token from the third on
    assert len(said) == N and end in chat.stop_ids and end not in said[:cut]
    head = test_gguf.tiny_hf_tensors()["lm_head.weight"]  # (V, D)
    head[end] = 1.05 * head[said[cut]]  # the end of turn outscores that token (its logit > 0)
    base = write_base(tmp_path / "base.gguf", extra={"output.weight": head})
    run = tmp_path / "run"
    merged = write_lora_run(run, base)
    expected = greedy(merged, chat, prompt, chat.stop_ids)
    assert expected == said[:cut]

    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--chat", QUESTION, "--max-new-tokens", str(N)]) == 0
    out, err = capsys.readouterr()
    assert out == chat.tokenizer.decode(expected) + "\n"
    lines = err.splitlines()
    assert lines[0] == f"loading {run} ..."
    assert lines[1].startswith(f"reading the frozen base {base} to merge the rank-2 adapters")
    assert f"chat template and stop ids: the frozen base {base}'s" in lines
    assert any(line.startswith("compiling the sampler: a prefill of 64 positions, a cache of 64 slots")
               for line in lines)
    assert lines[-1].startswith(f"1 x {cut + 1} tokens in ") and "prefill of " in lines[-1] \
        and "(key/value cache of 64 slots; compile " in lines[-1], lines[-1]


def test_every_path_says_what_it_does_and_times_it(tmp_path, capsys):
    """--init-from (prompt, chat) and --run (prompt over the cache above, here without it)."""
    base = write_base(tmp_path / "base.gguf")
    for argv in (["--init-from", base, "--prompt", "the cat"], ["--init-from", base, "--chat", QUESTION]):
        capsys.readouterr()
        assert main(["generate", *argv, "--max-new-tokens", "3", "--temperature", "0"]) == 0
        lines = capsys.readouterr().err.splitlines()
        assert lines[0] == f"loading {base} ..." and lines[1].startswith(f"sampling from {base} (2 layers")
        assert lines[2].startswith("compiling the sampler: a prefill of 64 positions")
        assert lines[-1].startswith("1 x ") and "decode at " in lines[-1] and " apart)" in lines[-1]
    run = tmp_path / "run"
    write_lora_run(run, base)
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompt", "the", "--max-new-tokens", "4", "--no-cache",
                 "--num-samples", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("--- sample") == 2
    assert captured.err.splitlines()[-1].startswith("2 x 4 tokens in ") and \
        "(no cache: the whole window per token; compile" in captured.err
    line = one_line_error(capsys, main(["generate", "--run", str(run), "--chat", "hi", "--num-samples", "2"]))
    assert line == "error: --num-samples is for --run --prompt; --chat samples one stream"
