"""Inputs that used to pass silently or end in a traceback, each refused in one line that
names what: characters a tokenizer's vocabulary lacks (encode, prepare, a GGUF file's
tokenizer), a PEFT folder whose tensors' rank is not its r, weights stored as integers or
as FP8, a quantized model folder, a config.json value named by its ModelConfig field, a
LoRA target the model lacks; and no libtpu message on a machine without a TPU. No model
is compiled here: each check is on files and shapes."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from helpers import one_line_error
from jaxformer.formats import hf_llama, hf_moe
from jaxformer.formats.hf import read_hf
from jaxformer.formats.hf_files import HFFormatError, load_safetensors
from jaxformer.formats.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_peft, save_peft
from jaxformer.model.config import ModelConfig
from jaxformer.model.lora import LoraConfig
from jaxformer.model.params import init_params
from jaxformer.training.settings import TrainSettings

tokenizers = pytest.importorskip("tokenizers")
from jaxformer.data.hf_tokenizers import HFTokenizer, VocabularyMiss  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ModelConfig(vocab_size=32, d_model=8, n_heads=2, n_layers=2, d_ff=12, max_seq_len=16, norm="pre",
                    norm_type="rms", positions="rope", mlp="gated", activation="silu", bias=False,
                    head_bias=False, family="llama")
SPECIAL = ["<|im_start|>", "<|im_end|>"]
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u0120", "\u010a"]  # a-z, space, newline


# ------------------------------------------------------------------ characters the vocabulary lacks

def _letters_tokenizer(name="letters"):
    """A byte-level BPE whose vocabulary is a-z, space, newline and two control tokens."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    tokens = SPECIAL + LETTERS
    tok = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return HFTokenizer(tok, name)


def test_encode_names_the_characters_the_vocabulary_lacks_and_where():
    tok = _letters_tokenizer()
    assert tok.encode("<|im_start|>the cat\n<|im_end|>").tolist()[0] == 0  # control tokens: whole ids
    with pytest.raises(VocabularyMiss) as e:
        tok.encode("the cat\nsat on 2 mats, caf\u00e9")
    assert e.value.misses == [("2", 2, 8), (",", 2, 14), ("\u00e9", 2, 19)]
    assert str(e.value).startswith("the vocabulary of letters lacks 3 character(s) of the text")
    assert "'2' (U+0032) at line 2, column 8" in str(e.value)
    with pytest.raises(VocabularyMiss, match="'!' .U\\+0021. at line 1, column 3"):
        tok.encode_batch(["ab", "ab!"])
    from jaxformer.data import ByteTokenizer, CharTokenizer, check_encodable  # before a prompt is shown
    with pytest.raises(VocabularyMiss, match="'A' .U\\+0041. at line 1, column 1"):
        check_encodable(tok, "Ab")
    with pytest.raises(ValueError, match="unknown character 'c'"):
        check_encodable(CharTokenizer("ab"), "abc")
    check_encodable(ByteTokenizer(), "\u00e9")
    from tokenizers import models  # a plain BPE without an unknown token drops what it cannot spell
    plain = HFTokenizer(tokenizers.Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])), "ab")
    with pytest.raises(VocabularyMiss, match="'c' .U\\+0063. at line 1, column 5"):
        plain.encode("a b c")


def test_gguf_tokenizer_refuses_what_its_vocabulary_lacks():
    """A GGUF file's vocabulary (what `generate --init-from FILE.gguf --prompt` encodes with)."""
    from jaxformer.formats.gguf_tokenizer import gguf_tokenizer
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": SPECIAL + LETTERS, "tokenizer.ggml.merges": [],
            "tokenizer.ggml.token_type": [3, 3] + [1] * len(LETTERS)}
    tok = gguf_tokenizer(meta, "tiny.gguf")
    assert len(tok.encode("<|im_start|>hi")) == 3
    with pytest.raises(VocabularyMiss, match=r"tiny\.gguf:tokenizer lacks 1 .* 'H' \(U\+0048\) at line 1, column 1"):
        tok.encode("Hi")


def test_prepare_names_the_file_and_the_character(tmp_path, capsys):
    from jaxformer.cli.main import main
    (tmp_path / "tokenizer.json").write_text(_letters_tokenizer().tokenizer.to_str())
    corpus = tmp_path / "notes.txt"
    corpus.write_text("the cat sat\non the mat\nthe dog ran to the park at noon\nit was hot\u2122\n")
    code = main(["prepare", "--corpus", str(corpus), "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--out", str(tmp_path / "data"), "--no-progress"])
    line = one_line_error(capsys, code)
    assert f"{corpus}: the vocabulary of tokenizer.json lacks 1 character(s)" in line
    assert "'\u2122' (U+2122) at line 4, column 11" in line


# ------------------------------------------------------------------ PEFT

def test_peft_rank_other_than_its_r_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    L, D, r = 2, 8, 4
    adapters = {"blocks": {"attn": {"wq": {"a": rng.standard_normal((L, D, r)), "b": rng.standard_normal((L, r, D))}}}}
    save_peft(tmp_path, adapters, LoraConfig(rank=r, targets="q"))
    assert read_peft(tmp_path, L)[1].rank == r
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, "r": 8}))
    with pytest.raises(HFFormatError) as e:
        read_peft(tmp_path, L)
    message = str(e.value)
    assert message.startswith(f"{tmp_path / ADAPTER_WEIGHTS}: tensor "
                              "'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' has shape (4, 8), "
                              "rank 4, but adapter_config.json says r = 8"), message


# ------------------------------------------------------------------ weights that are not floats

def _llama_folder(folder):
    shapes = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), LLAMA))
    rng = np.random.default_rng(1)
    params = jax.tree_util.tree_map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)
    hf_llama.write_hf_llama(folder, params, LLAMA)
    return folder


def _rewrite_safetensors(path, change):
    """The safetensors file at ``path`` with its tensors {name: array} passed through ``change``."""
    from safetensors.numpy import save_file
    save_file(change(dict(load_safetensors(path))), str(path))


def test_integer_weights_are_refused_by_name(tmp_path):
    folder = _llama_folder(tmp_path / "llama")
    read_hf(folder)  # float32: read
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite_safetensors(folder / "model.safetensors", lambda t: {**t, name: (t[name] * 100).astype(np.int32)})
    with pytest.raises(HFFormatError) as e:
        read_hf(folder)
    assert str(e.value) == (f"{folder}: tensor '{name}' is stored as int32, not as floating-point weights "
                            "(quantized or integer tensors are not read)")


def test_fp8_tensor_is_refused_not_a_traceback(tmp_path, corpus, capsys):
    from jaxformer.cli.main import main
    folder = _llama_folder(tmp_path / "fp8")
    path = folder / "model.safetensors"
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [0, 4]}})
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(4))
    with pytest.raises(HFFormatError, match=r"model\.safetensors: tensor 'model\.embed_tokens\.weight' has dtype "
                                            r"F8_E4M3, which is not read"):
        load_safetensors(path)
    line = one_line_error(capsys, main(["train", "--init-from", str(folder), "--corpus", corpus, "--steps", "1",
                                        "--out", str(tmp_path / "run"), "--no-progress"]))
    assert f"{path}: tensor 'model.embed_tokens.weight' has dtype F8_E4M3" in line, line


@pytest.mark.parametrize("quant", [
    {"quant_method": "gptq", "bits": 4, "group_size": 128},
    {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},  # weight_scale_inv beside each
    {"quant_method": "bitsandbytes", "load_in_4bit": True},
])
def test_quantized_folder_is_refused_by_its_method(tmp_path, quant, capsys):
    folder = _llama_folder(tmp_path / "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(HFFormatError, match=f"config.json: quantization_config quant_method '{quant['quant_method']}'"
                                            ": quantized weights are not read"):
        read_hf(folder)


# ------------------------------------------------------------------ config.json's own key names

def test_config_json_messages_name_the_file_keys():
    hf = {"model_type": "mixtral", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 64,
          "num_local_experts": 4, "num_experts_per_tok": 6}
    with pytest.raises(HFFormatError) as e:
        hf_moe.config_from_hf(hf)
    assert str(e.value) == "config.json: num_experts_per_tok (6) must be at most num_local_experts (4)"
    with pytest.raises(HFFormatError) as e:
        hf_llama.config_from_hf({**hf, "model_type": "llama", "num_key_value_heads": 3})
    assert str(e.value).startswith("config.json: num_key_value_heads (3) must divide num_attention_heads (4)")


# ------------------------------------------------------------------ LoRA targets

def test_lora_target_the_model_lacks_is_refused_with_what_it_has():
    moe = {"mlp": "gated", "activation": "silu", "bias": False, "n_experts": 4, "experts_per_token": 2}
    settings = TrainSettings(preset="tiny", model=moe, seq_len=16, lora_rank=2, lora_targets="q,gate")
    with pytest.raises(ValueError) as e:
        settings.validate()
    assert str(e.value) == ("lora_targets gate name no projection of this model (its projections: q, k, v, o; "
                            "an MoE layer's experts take no adapters)")
    settings.replace(lora_targets="q,o").validate()
    settings.replace(lora_targets="all").validate()  # every projection there is
    with pytest.raises(ValueError, match=r"lora_targets down name no projection .*its projections: q, k, v, o, "
                                         r"in, out\)"):
        TrainSettings(preset="tiny", seq_len=16, lora_rank=2, lora_targets="q,down").validate()


# ------------------------------------------------------------------ the documentation

def test_models_page_says_llama_rope_scaling_is_read():
    row = next(line for line in (ROOT / "docs" / "models.md").read_text().splitlines() if line.startswith("| `llama` |"))
    assert "not yet" not in row and "llama3" in row and "yarn" in row


# ------------------------------------------------------------------ libtpu on a machine without a TPU

def test_no_libtpu_message_without_a_tpu():
    """What `jaxformer` does before any command, on a machine with no TPU and no GPU,
    JAX_PLATFORMS unset and libtpu installed: JAX starts on the CPU without libtpu's
    TPU_WORKER_HOSTNAMES error block (a subprocess: this one's JAX has started)."""
    import importlib.util
    from jaxformer.cli.platforms import GOOGLE_PCI_VENDOR, GPU_DEVICES
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (the dev extra): nothing to silence")
    vendors = [Path(v).read_text().strip() for v in __import__("glob").glob("/sys/bus/pci/devices/*/vendor")]
    if GOOGLE_PCI_VENDOR in vendors or any(os.path.exists(d) for d in GPU_DEVICES):
        pytest.skip("this machine has an accelerator")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = ("import importlib.util, jax\n"  # the module alone, without the package's imports
            f"spec = importlib.util.spec_from_file_location('platforms', {str(ROOT / 'jaxformer/cli/platforms.py')!r})\n"
            "platforms = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(platforms)\n"
            "assert platforms.cpu_only_without_tpu_probe()\nprint(jax.devices())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "CpuDevice" in out.stdout and "TPU" not in out.stderr, out.stderr
