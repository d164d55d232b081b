"""Exports that chat (jaxformer/cli/export.py, formats/hf_chat_files.py, run_source.py):
a LoRA run over a tiny GGUF chat model (test_gguf's, with its ChatML template), taught one
answer, exported as the merged model, its frozen base and the PEFT adapter. transformers'
generate on the merged folder renders the template, stops at <|im_end|> and says what
`jaxformer generate --init-from OUT --chat` says; PEFT's AutoPeftModelForCausalLM loads the
adapter onto the base it names and answers the same."""

import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("gguf")

from helpers import one_line_error  # noqa: E402
from test_gguf import tiny_hf_tensors, tiny_tokenizer_meta, write_tiny  # noqa: E402

from jaxformer.cli.main import main  # noqa: E402
from jaxformer.formats.run_source import base_name  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_export_chat")  # one worker: its module fixture (lora_run) runs once

QUESTION, ANSWER = "where did the cat sit?", "On the mat."
MAX_NEW = 16


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(GGUF file, run folder): LoRA rank 4 on every projection, 40 steps on one conversation, 16 times."""
    d = tmp_path_factory.mktemp("chat_lora")
    model = write_tiny(d / "tiny.gguf", tiny_hf_tensors(), add_meta=tiny_tokenizer_meta)
    chats = d / "chats.jsonl"
    chats.write_text((json.dumps({"prompt": QUESTION, "completion": ANSWER}) + "\n") * 16)
    assert main(["prepare", "--corpus", str(chats), "--tokenizer", str(model), "--out", str(d / "data"),
                 "--no-progress"]) == 0
    assert main(["train", "--init-from", str(model), "--data", str(d / "data"), "--out", str(d / "run"),
                 "--lora-rank", "4", "--lora-targets", "all", "--steps", "40", "--lr", "0.03",
                 "--schedule", "constant", "--warmup-steps", "0", "--seq-len", "64", "--batch-size", "4",
                 "--eval-every", "0", "--no-progress", "--ignore-memory-check"]) == 0
    return model, d / "run"


def greedy_reply(model, tokenizer):
    """The token ids transformers' greedy generate adds after QUESTION in the chat template."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=MAX_NEW, do_sample=False)
    return out[0, prompt["input_ids"].shape[1]:].tolist()


def test_exports_chat_in_transformers_peft_and_jaxformer(lora_run, tmp_path, capsys):
    model, run = lora_run
    merged, adapter, base = tmp_path / "merged", tmp_path / "adapter", tmp_path / "base"
    capsys.readouterr()
    assert main(["export", "--run", str(run), "--hf", str(merged), "--merge", "--peft", str(adapter),
                 "--base", str(base)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(f"naming base {base}" in line and "AutoPeftModelForCausalLM" in line for line in lines), lines
    assert all("chat template and stop ids [0, 2]" in line for line in lines if str(merged) in line)
    for folder in (merged, adapter, base):
        generation = json.loads((folder / "generation_config.json").read_text())
        assert generation == {"bos_token_id": 1, "eos_token_id": [2, 0], "pad_token_id": 2}
        assert "<|im_start|>" in json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)

    tokenizer = transformers.AutoTokenizer.from_pretrained(merged)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    assert theirs.generation_config.eos_token_id == [2, 0]  # <|im_end|>, <|endoftext|>
    reply = greedy_reply(theirs, tokenizer)
    assert len(reply) < MAX_NEW and reply[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")  # stopped
    assert tokenizer.decode(reply, skip_special_tokens=True) == ANSWER

    capsys.readouterr()
    assert main(["generate", "--init-from", str(merged), "--chat", QUESTION,
                 "--max-new-tokens", str(MAX_NEW)]) == 0
    assert capsys.readouterr().out == ANSWER + "\n"  # the same greedy text, stopped at the same place

    adapted = peft.AutoPeftModelForCausalLM.from_pretrained(str(adapter), dtype=torch.float32).eval()
    assert greedy_reply(adapted, transformers.AutoTokenizer.from_pretrained(adapter)) == reply


def test_adapter_names_a_base_peft_resolves(lora_run, tmp_path, capsys):
    """Without --base the adapter over a GGUF names the hub repository the file records, else
    none (said on the export's line); a folder by its path, a hub id as it is."""
    model, run = lora_run
    capsys.readouterr()
    assert main(["export", "--run", str(run), "--peft", str(tmp_path / "ad")]) == 0
    assert "naming no base (" in capsys.readouterr().out
    assert json.loads((tmp_path / "ad" / "adapter_config.json").read_text())["base_model_name_or_path"] is None

    def source(w):
        tiny_tokenizer_meta(w)
        w.add_source_url("https://huggingface.co/owner/tiny-chat")
    sourced = write_tiny(tmp_path / "sourced.gguf", tiny_hf_tensors(), add_meta=source)
    assert base_name(str(sourced))[0] == "owner/tiny-chat"
    parent = write_tiny(tmp_path / "parent.gguf", tiny_hf_tensors(),
                        add_meta=lambda w: w.add_base_model_repo_url(0, "https://huggingface.co/owner/parent"))
    assert base_name(str(parent))[0] is None  # the model the source was tuned from: other weights
    assert base_name(str(tmp_path))[0] == os.path.abspath(tmp_path)
    assert base_name("owner/name")[0] == "owner/name"
    assert base_name(None)[0] is None


def test_export_refusals_are_one_line(lora_run, tmp_path, capsys):
    _, run = lora_run
    line = one_line_error(capsys, main(["export", "--run", str(run), "--peft", str(tmp_path / "x"),
                                        "--base", str(tmp_path / "x")]))
    assert "--peft and --base name the same folder" in line



def test_run_chat_falls_back_to_the_chat_data(lora_run):
    """A run whose model cannot be read again (moved) takes the template its chat data was
    prepared with, the stop ids looked up in the run's tokenizer; with neither, none and why."""
    from types import SimpleNamespace

    from jaxformer.formats.hf import read_chat
    from jaxformer.formats.run_source import run_chat
    model, run = lora_run
    tokenizer = read_chat(model).tokenizer
    moved = SimpleNamespace(lora_base=str(run.parent / "moved.gguf"), tokenizer="byte", data=str(run.parent / "data"))
    chat, where = run_chat(moved, tokenizer)
    assert chat.chat_template == read_chat(model).chat_template and chat.stop_ids == (0, 2)
    assert where == f"the chat data {run.parent / 'data'}"
    chat, why = run_chat(SimpleNamespace(lora_base=moved.lora_base, tokenizer="byte", data=None), tokenizer)
    assert chat is None and "moved.gguf: no such GGUF file" in why
