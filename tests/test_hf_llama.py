"""Hugging Face Llama in and out, against transformers itself (float64, nothing downloaded):
small random LlamaForCausalLMs (grouped-query and multi-head, tied and untied, with and
without biases, rope_theta not 10000) saved, imported, and shown equal in logits (1e-10
relative) and in gradients (jax.grad and manual vs torch autograd, 1e-10 per leaf); the
exported folder reloads with the same logits. Bad folders and unexportable models get
one named error; the commands run end to end.

transformers computes the RMS norm and the rotary tables in float32 whatever the model's
dtype (and eager attention its softmax): the reference here runs those two modules in
float64, the same formulas with the module's own weight, eps and theta (``float64_llama``),
and attention through SDPA, which keeps float64. Unpatched, the two agree to ~1e-7, float32's
round-off."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_compare import (FORWARD, D, F, H, L, S, V, assert_export_reloads, assert_forward_matches,  # noqa: E402
                        assert_grads_equal, assert_grads_match_torch, assert_logits_equal, batch, copy_folder,
                        default_rope, float64_model, random_folder, torch_logits, torch_reference)

from jaxformer.formats.hf import HFFormatError, hf_format, read_hf, write_hf  # noqa: E402
from jaxformer.model.config import PRESETS  # noqa: E402
from jaxformer.tools.compare.hf_random import random_hf_model  # noqa: E402
from test_rope_scaling import transformers_rope  # noqa: E402

jax.config.update("jax_enable_x64", True)
# name: LlamaConfig overrides. GQA (2 kv heads of 4) untied; MHA tied with both biases and GeGLU
VARIANTS = {
    "gqa-untied": dict(num_key_value_heads=2, tie_word_embeddings=False),
    "mha-tied-bias": dict(num_key_value_heads=H, tie_word_embeddings=True, attention_bias=True,
                          mlp_bias=True, hidden_act="gelu_pytorch_tanh"),
}


def llama_config(**overrides):
    kw = dict(vocab_size=V, hidden_size=D, intermediate_size=F, num_attention_heads=H,
              num_hidden_layers=L, max_position_embeddings=S, rms_norm_eps=1e-5, rope_theta=5000.0,
              bos_token_id=1, eos_token_id=2)
    return transformers.LlamaConfig(**{**kw, **overrides})


def random_llama(cfg, seed=0):
    """A LlamaForCausalLM with every leaf random: unit norm scales or zero biases would hide errors."""
    return random_hf_model("LlamaForCausalLM", cfg, seed)


def llama_rope(module, rope, dim):
    """The default rotary in float64, or transformers' own rule (llama3, linear, yarn) in float64."""
    if module.rope_type == "default":
        return default_rope(module, rope, dim)
    inv_freq, scale = transformers_rope(module.config)
    return torch.from_numpy(inv_freq), scale


def float64_llama(folder):
    """transformers' Llama from ``folder`` in float64 end to end: SDPA attention, and the
    RMS norms and rotary tables (float32 inside transformers) computed in float64."""
    return float64_model("LlamaForCausalLM", folder, rope=llama_rope)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def saved(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    random_llama(llama_config(**VARIANTS[request.param])).save_pretrained(folder)
    return float64_llama(folder), folder


def test_import_matches_transformers_logits(saved):
    model, folder = saved
    params, config = read_hf(folder, np.float64)
    hf = model.config
    assert (config.norm_type, config.positions, config.mlp, config.rope_theta) == ("rms", "rope", "gated", 5000.0)
    assert (config.kv_heads, config.tie_embeddings, config.bias) == (
        hf.num_key_value_heads, hf.tie_word_embeddings, hf.attention_bias)
    assert ("head" in params) == (not config.tie_embeddings)
    assert params["blocks"]["attn"]["wk"].shape == (L, D, hf.num_key_value_heads * D // H)
    assert_forward_matches(model, folder, params, config)


@pytest.mark.parametrize("source", ["jax.grad", "manual"])
def test_gradients_match_torch_autograd(saved, source):
    model, folder = saved
    assert_grads_match_torch(model, folder, source)


def test_export_reloads_in_transformers(saved, tmp_path):
    model, folder = saved
    params, config = read_hf(folder, np.float64)
    # the file holds float32: equal to float32 round-off to the params written, and to float64
    # round-off to the params read back
    _, _, out = assert_export_reloads(tmp_path, params, config, "llama", "LlamaForCausalLM", float64_llama)
    assert json.loads((out / "config.json").read_text())["rope_parameters"]["rope_theta"] == 5000.0


def test_sharded_bf16_and_torch_bin(tmp_path):
    model = random_llama(llama_config(num_key_value_heads=1, tie_word_embeddings=False), seed=1)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="10KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    params, config = read_hf(tmp_path / "sharded", np.float64)
    assert config.kv_heads == 1
    ref = torch_logits(float64_llama(tmp_path / "sharded"), batch()["inputs"])
    assert_logits_equal(np.asarray(FORWARD(params, batch()["inputs"], config)), ref)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    half, _ = read_hf(tmp_path / "bf16", np.float32)
    np.testing.assert_array_equal(half["tok_embed"],
                                  model.model.embed_tokens.weight.float().detach().numpy())
    torch.save(model.float().state_dict(), tmp_path / "bf16" / "pytorch_model.bin")
    (tmp_path / "bf16" / "model.safetensors").unlink()
    from_bin, _ = read_hf(tmp_path / "bf16", np.float32)
    np.testing.assert_array_equal(from_bin["blocks"]["ffn"]["w_down"], half["blocks"]["ffn"]["w_down"])


def test_bad_folders_are_one_named_line(saved, tmp_path):
    _, folder = saved
    cases = [
        (dict(config={"model_type": "mamba"}), "model_type 'mamba' is not supported.*gpt2, llama"),
        (dict(config={"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 8.0}}),
         "rope_parameters rope_type 'dynamic' is not supported"),
        (dict(config={"rope_parameters": None, "rope_scaling": {"type": "longrope", "factor": 2.0}}),
         "rope_scaling rope_type 'longrope'"),
        (dict(tensors=lambda t: {k: v for k, v in t.items() if "layers.1.mlp.up_proj.weight" not in k}),
         "'model.layers.1.mlp.up_proj.weight' is missing"),
        (dict(tensors=lambda t: {**t, "model.norm.weight": t["model.norm.weight"][:5]}),
         r"'model.norm.weight' has shape \(5,\)"),
    ]
    for i, (edit, message) in enumerate(cases):
        with pytest.raises(HFFormatError, match=message) as e:
            read_hf(copy_folder(tmp_path, folder, f"case{i}", **edit), np.float64)
        assert "\n" not in str(e.value)


def test_export_refuses_what_llama_cannot_hold(tmp_path):
    """The format is chosen by the config and refuses, by name, before reading any param."""
    for config, option in [
        (PRESETS["llama-tiny"], "qk_norm"),  # QK-norm: Llama has none
        (PRESETS["llama-tiny"].replace(qk_norm=False, positions="learned"), "positions"),
        (PRESETS["tiny"].replace(mlp="gated"), "norm_type"),  # layer norm with the gated MLP
        (PRESETS["llama-tiny"].replace(qk_norm=False, head_bias=True), "head_bias"),
    ]:
        assert hf_format(config) == "llama"
        with pytest.raises(ValueError, match=f"Llama needs ModelConfig.{option} ") as e:
            write_hf(tmp_path / option, {}, config)
        assert "\n" not in str(e.value) and not (tmp_path / option).exists()
    config = PRESETS["gpt2"].replace(activation="silu")  # GPT-2's options but an activation it lacks
    assert hf_format(config) == "gpt2"
    with pytest.raises(ValueError, match="GPT-2 needs ModelConfig.activation"):
        write_hf(tmp_path / "silu", {}, config)


# ---------------------------------------------------------------- the commands


def run_cli(*argv):
    from jaxformer.cli.main import main
    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def byte_llama(tmp_path_factory):
    """A random Llama (grouped-query, untied) with the byte tokenizer's 256-token vocabulary, saved."""
    return random_folder(tmp_path_factory.mktemp("llama256"), "LlamaForCausalLM",
                         llama_config(vocab_size=256, num_key_value_heads=2, tie_word_embeddings=False), 3)


@pytest.mark.parametrize("grads", ["auto", "manual"])
def test_fine_tune_export_generate(byte_llama, corpus, tmp_path, grads, capsys):
    out = tmp_path / "ft"
    assert run_cli("train", "--init-from", byte_llama, "--grads", grads, "--steps", 3, "--seq-len", 16,
                   "--batch-size", 4, "--corpus", corpus, "--out", out, "--no-progress",
                   "--eval-every", 0) == 0
    assert run_cli("export", "--run", out, "--hf", tmp_path / "hf") == 0
    assert "llama" in capsys.readouterr().out
    params, config = read_hf(tmp_path / "hf", np.float64)
    start, config0 = read_hf(byte_llama, np.float64)
    assert config == config0  # the imported model's options, rope_theta and GQA included
    assert not np.allclose(start["tok_embed"], params["tok_embed"])  # fine-tuning moved it
    ids = np.arange(20)[None] % 256
    ref = torch_logits(float64_llama(tmp_path / "hf"), ids)
    assert_logits_equal(np.asarray(FORWARD(params, jnp.asarray(ids, jnp.int32), config)), ref)
    assert run_cli("generate", "--run", out, "--prompt", "the", "--max-new-tokens", 5) == 0
    assert capsys.readouterr().out.strip()


def test_init_from_refuses_shape_flags(byte_llama, corpus, tmp_path, capsys):
    assert run_cli("train", "--init-from", byte_llama, "--n-kv-heads", 4, "--steps", 1, "--seq-len", 16,
                   "--corpus", corpus, "--out", tmp_path / "a") == 2
    assert "--n-kv-heads" in capsys.readouterr().err


def test_compare_grads_on_imported_llama(byte_llama, tmp_path, capsys):
    assert run_cli("compare-grads", "--init-from", byte_llama, "--batch-size", 2, "--seq-len", 16,
                   "--repeats", 1, "--out", tmp_path / "cmp") == 0
    assert "hf:" in capsys.readouterr().out


# ---------------------------------------------------------------- rotary scaling (llama3, linear, yarn)

# Dh 16 at base 100 over an original context of 16, sequences of 32: every band of each rule
# (kept, blended, divided) holds some of the 8 frequencies.
SCALED = {
    "llama3": {"rope_type": "llama3", "rope_theta": 100.0, "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 2.0, "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "rope_theta": 100.0, "factor": 2.5},
    "yarn": {"rope_type": "yarn", "rope_theta": 100.0, "factor": 2.0, "beta_fast": 8.0, "beta_slow": 0.5,
             "original_max_position_embeddings": 16},
}


@pytest.fixture(scope="module", params=sorted(SCALED))
def scaled(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("rope-" + request.param)
    cfg = llama_config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                       rope_parameters=dict(SCALED[request.param]))
    random_llama(cfg, seed=5).save_pretrained(folder)
    return float64_llama(folder), folder


def long_batch(seed):
    rng = np.random.default_rng(seed)
    return {"inputs": jnp.asarray(rng.integers(0, V, (2, S)), jnp.int32),
            "targets": jnp.asarray(rng.integers(0, V, (2, S)), jnp.int32)}


def test_scaled_rope_imports_with_transformers_logits_and_grads(scaled):
    model, folder = scaled
    params, config = read_hf(folder, np.float64)
    kind = model.config.rope_parameters["rope_type"]
    assert config.rope_scaling == kind and config.rope_factor == SCALED[kind]["factor"]
    b = long_batch(0)
    ours, ref = np.asarray(FORWARD(params, b["inputs"], config)), torch_logits(model, b["inputs"])
    print(f"\n{kind}: logits max |diff| / max |ref| {np.abs(ours - ref).max() / np.abs(ref).max():.1e}")
    assert_logits_equal(ours, ref)
    unscaled = np.asarray(FORWARD(params, b["inputs"], config.replace(rope_scaling="none")))
    assert not np.allclose(unscaled, ref, rtol=1e-3)  # the rule matters at these positions
    ref_loss, ref_grads = torch_reference(model, config, b)
    for source in ("jax.grad", "manual"):
        rows = assert_grads_equal(params, b, config, source, ref_loss, ref_grads)  # 1e-10 per leaf
        worst = max(rows, key=lambda r: r.rel)
        print(f"{kind} {source}: worst leaf {worst.path} relative {worst.rel:.1e}")


def test_scaled_rope_export_reloads_in_transformers(scaled, tmp_path):
    model, folder = scaled
    params, config = read_hf(folder, np.float64)
    out, kind = write_hf(tmp_path / "out", params, config)
    back = float64_llama(out)
    want, got = model.config.rope_parameters, back.config.rope_parameters
    assert {k: got[k] for k in want} == want  # every key the source has, with its value
    assert {k: got[k] for k in set(got) - set(want)} in ({}, {"truncate": True})  # yarn's default, written
    again, config2 = read_hf(out, np.float64)
    assert config2 == config
    b = long_batch(1)
    assert_logits_equal(np.asarray(FORWARD(again, b["inputs"], config)), torch_logits(back, b["inputs"]))
