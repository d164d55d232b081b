"""The Llama-shaped Hugging Face families against transformers itself (float64, nothing
downloaded): small random ``Qwen2ForCausalLM`` (q, k, v biases only), ``Qwen3ForCausalLM``
(per-head QK-norm, a head_dim that is not hidden / heads, with and without attention_bias),
``MistralForCausalLM`` (sliding_window null and a wider head_dim; a window of 3 on every layer),
sliding-window Qwen 2 (from max_window_layers) and Qwen 3 (layer_types: a sliding and a full
layer), each window shorter than the batch's 11 tokens, and a ``LlamaForCausalLM`` with
attention biases but no MLP bias, saved, imported, and shown equal in logits (1e-10 relative)
and in gradients (jax.grad and manual vs torch autograd, 1e-10 per leaf); the export writes
the same family and reloads with the same logits. Then the folders that must not load
silently wrong: a tied config with its own stored head (transformers keeps the head, untied:
so does the import), damaged index / bin files and config values of the wrong type, and the
window keys of the wrong type, each one line naming the file and key.

As in test_hf_llama.py, transformers computes its RMS norms (the q_norm and k_norm too) and
rotary tables in float32 whatever the model's dtype: the reference runs them in float64, the
same formulas with the module's own weight, eps and theta (hf_compare.float64_model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import hf_compare  # noqa: E402
from hf_compare import (FORWARD, D, F, H, L, S, V, assert_export_reloads, assert_forward_matches,  # noqa: E402
                        assert_grads_match_torch, assert_logits_equal, batch, copy_folder, random_folder, torch_logits)

from jaxformer.formats.hf import HFFormatError, read_hf, write_hf  # noqa: E402

jax.config.update("jax_enable_x64", True)
CLASSES = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
           "mistral": ("MistralConfig", "MistralForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM")}
# name: (model_type, config overrides, what the import must make of it: (head_dim, linear_biases, qk_norm,
# (sliding_window, layer_types)))
VARIANTS = {
    "qwen2-gqa": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=False), (0, (True, False, False), False, (0, ()))),
    "qwen2-window-layers": ("qwen2", dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=4,
                                          max_window_layers=1, tie_word_embeddings=False),
                            (0, (True, False, False), False, (4, ("full_attention", "sliding_attention")))),
    "qwen3-wide-tied": ("qwen3", dict(num_key_value_heads=2, head_dim=6, tie_word_embeddings=True),
                        (6, (False, False, False), True, (0, ()))),
    "qwen3-window-types": ("qwen3", dict(num_key_value_heads=2, head_dim=6, use_sliding_window=True, sliding_window=3,
                                         layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False),
                           (6, (False, False, False), True, (3, ("sliding_attention", "full_attention")))),
    "qwen3-bias-mqa": ("qwen3", dict(num_key_value_heads=1, head_dim=8, attention_bias=True,
                                     tie_word_embeddings=False), (8, (True, True, False), True, (0, ()))),
    "mistral-wide": ("mistral", dict(num_key_value_heads=2, head_dim=8, sliding_window=None,
                                     tie_word_embeddings=False), (8, (False, False, False), False, (0, ()))),
    "mistral-window": ("mistral", dict(num_key_value_heads=2, sliding_window=3, tie_word_embeddings=False),
                       (0, (False, False, False), False, (3, ()))),
    "llama-attn-bias": ("llama", dict(num_key_value_heads=2, head_dim=6, attention_bias=True, mlp_bias=False,
                                      tie_word_embeddings=False), (6, (True, True, False), False, (0, ()))),
}


def hf_config(kind, **overrides):
    kw = dict(vocab_size=V, hidden_size=D, intermediate_size=F, num_attention_heads=H,
              num_hidden_layers=L, max_position_embeddings=S, rms_norm_eps=1e-5, rope_theta=5000.0,
              bos_token_id=1, eos_token_id=2)
    return getattr(transformers, CLASSES[kind][0])(**{**kw, **overrides})


def float64_model(kind, folder):
    return hf_compare.float64_model(CLASSES[kind][1], folder)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def saved(request, tmp_path_factory):
    kind, overrides, want = VARIANTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    random_folder(folder, CLASSES[kind][1], hf_config(kind, **overrides))
    return kind, float64_model(kind, folder), folder, want


def test_import_matches_transformers_logits(saved):
    kind, model, folder, (head_dim, biases, qk_norm, windows) = saved
    params, config = read_hf(folder, np.float64)
    assert (config.family, config.head_dim, tuple(config.linear_biases), config.qk_norm) == (
        kind, head_dim, biases, qk_norm)
    assert (config.sliding_window, config.layer_types) == windows
    Dh = head_dim or D // H
    assert params["blocks"]["attn"]["wq"].shape == (L, D, H * Dh)
    assert params["blocks"]["attn"]["wo"].shape == (L, H * Dh, D)
    assert_forward_matches(model, folder, params, config)


@pytest.mark.parametrize("source", ["jax.grad", "manual"])
def test_gradients_match_torch_autograd(saved, source):
    _, model, folder, _ = saved
    assert_grads_match_torch(model, folder, source)


def test_export_writes_the_family_and_reloads(saved, tmp_path):
    kind, _, folder, _ = saved
    params, config = read_hf(folder, np.float64)
    assert_export_reloads(tmp_path, params, config, kind, CLASSES[kind][1], lambda out: float64_model(kind, out))


def test_export_refuses_biases_the_family_lacks(saved, tmp_path):
    kind, _, folder, _ = saved
    _, config = read_hf(folder, np.float64)
    wrong = {"qwen2": dict(out_bias=True), "qwen3": dict(mlp_bias=True), "mistral": dict(qkv_bias=True),
             "llama": dict(out_bias=not config.linear_biases.qkv)}[kind]
    with pytest.raises(ValueError, match=f"needs ModelConfig.{next(iter(wrong))} = ") as e:
        write_hf(tmp_path / "x", {}, config.replace(**wrong))
    assert "\n" not in str(e.value) and not (tmp_path / "x").exists()


# ---------------------------------------------------------------- folders that must not load wrong


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return random_folder(tmp_path_factory.mktemp("llama-tied"), CLASSES["llama"][1],
                         hf_config("llama", num_key_value_heads=2, tie_word_embeddings=True), 4)


def test_tied_config_with_its_own_head_loads_as_transformers_does(llama_folder, tmp_path):
    """transformers keeps a stored lm_head.weight that differs from the embedding, untied
    (with a warning): the import does the same, and the logits agree."""
    head = np.random.default_rng(0).normal(size=(V, D)).astype(np.float32)
    own = copy_folder(tmp_path, llama_folder, "own", tensors=lambda t: {**t, "lm_head.weight": head})
    params, config = read_hf(own, np.float64)
    assert not config.tie_embeddings and np.array_equal(params["head"]["w"], head.T)
    b = batch(3)
    assert_logits_equal(np.asarray(FORWARD(params, b["inputs"], config)),
                        torch_logits(float64_model("llama", own), b["inputs"]))
    same = copy_folder(tmp_path, llama_folder, "same",
                       tensors=lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"]})
    params, config = read_hf(same, np.float64)  # the embedding's copy: still tied, the copy skipped
    assert config.tie_embeddings and "head" not in params


def _damaged(tmp_path, folder, name, files):
    out = copy_folder(tmp_path, folder, name)
    (out / "model.safetensors").unlink()
    for file, text in files.items():
        (out / file).write_bytes(text)
    return out


@pytest.mark.parametrize("name, files, message", [
    ("no-map", {"model.safetensors.index.json": b'{"metadata": {}}'},
     r"model.safetensors.index.json: weight_map .* is missing"),
    ("not-json", {"model.safetensors.index.json": b"{weight_map"},
     r"model.safetensors.index.json is not valid JSON"),
    ("bad-bin", {"pytorch_model.bin": b"PK\x03\x04 not a zip at all"},
     r"pytorch_model.bin cannot be read by torch.load"),
])
def test_damaged_weight_files_are_one_named_line(llama_folder, tmp_path, name, files, message):
    with pytest.raises(HFFormatError, match=message) as e:
        read_hf(_damaged(tmp_path, llama_folder, name, files), np.float64)
    assert "\n" not in str(e.value) and name in str(e.value)


@pytest.mark.parametrize("edit, message", [
    ({"hidden_size": "32"}, "config.json: hidden_size must be a positive integer, got '32'"),
    ({"rms_norm_eps": None}, "config.json: rms_norm_eps must be a finite number, got None"),
    ({"rope_theta": "abc", "rope_parameters": None}, "config.json: rope_theta"),
    ({"head_dim": "8"}, "config.json: head_dim must be a positive integer, got '8'"),
    ({"attention_bias": "yes"}, "config.json: attention_bias must be true or false, got 'yes'"),
    ({"tie_word_embeddings": "false"}, "config.json: tie_word_embeddings must be True or False"),
    ({"model_type": "mistral", "sliding_window": 0}, "config.json: sliding_window must be a positive integer or "
                                                     "null, got 0"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": "8"},
     "config.json: sliding_window must be a positive integer or null, got '8'"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4, "max_window_layers": -1},
     "config.json: max_window_layers must be a non-negative integer, got -1"),
    ({"model_type": "qwen3", "layer_types": ["full_attention"]}, "config.json: layer_types must list 2 entries"),
    ({"model_type": "qwen3", "layer_types": ["full_attention", "local"]}, "config.json: layer_types must list 2"),
])
def test_bad_config_values_are_one_named_line(llama_folder, tmp_path, edit, message):
    folder = copy_folder(tmp_path, llama_folder, "bad", config=edit)
    with pytest.raises(HFFormatError, match=message) as e:
        read_hf(folder, np.float64)
    assert "\n" not in str(e.value) and str(folder) in str(e.value)


def test_mistral_window_that_covers_the_sequence_loads(llama_folder, tmp_path):
    folder = copy_folder(tmp_path, llama_folder, "w", config={"model_type": "mistral", "sliding_window": S})
    assert read_hf(folder, np.float64)[1].replace(sliding_window=0) == read_hf(llama_folder, np.float64)[1].replace(
        family="mistral")


def test_export_refuses_a_window_the_family_cannot_hold(saved, tmp_path):
    kind, _, folder, _ = saved
    _, config = read_hf(folder, np.float64)
    windowed = config.replace(sliding_window=3, layer_types=("sliding_attention", "full_attention"))
    if kind in ("qwen2", "qwen3"):
        return
    match = {"mistral": "one sliding window for every layer", "llama": "a Hugging Face Llama has no sliding window"}
    with pytest.raises(ValueError, match=match[kind]) as e:
        write_hf(tmp_path / "x", {}, windowed)
    assert "\n" not in str(e.value) and not (tmp_path / "x").exists()


# ---------------------------------------------------------------- the commands


def run_cli(*argv):
    from jaxformer.cli.main import main
    return main([str(a) for a in argv])


def test_fine_tune_export_generate_qwen3(corpus, tmp_path, capsys):
    folder = random_folder(tmp_path / "qwen3", CLASSES["qwen3"][1], hf_config(
        "qwen3", vocab_size=256, num_key_value_heads=2, head_dim=6, tie_word_embeddings=False), 5)
    out = tmp_path / "ft"
    assert run_cli("train", "--init-from", folder, "--grads", "manual", "--steps", 3, "--seq-len", 16,
                   "--batch-size", 4, "--corpus", corpus, "--out", out, "--no-progress",
                   "--eval-every", 0) == 0
    assert run_cli("export", "--run", out, "--hf", tmp_path / "hf") == 0
    assert "qwen3" in capsys.readouterr().out
    params, config = read_hf(tmp_path / "hf", np.float64)
    assert config == read_hf(folder, np.float64)[1]
    ids = np.arange(20)[None] % 256
    ref = torch_logits(float64_model("qwen3", tmp_path / "hf"), ids)
    assert_logits_equal(np.asarray(FORWARD(params, jnp.asarray(ids, jnp.int32), config)), ref)
    assert run_cli("generate", "--run", out, "--prompt", "the", "--max-new-tokens", 5) == 0
    assert capsys.readouterr().out.strip()
