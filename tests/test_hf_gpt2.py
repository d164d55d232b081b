"""Hugging Face GPT-2 in and out, against transformers itself (float64, nothing
downloaded): a small random GPT2LMHeadModel saved, imported, and shown equal in logits
(1e-10 relative) and in gradients (manual and jax.grad vs torch autograd, 1e-10 per
leaf, the tied embedding included); the exported folder reloads with the same logits.
Bad folders get one named error."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_compare import FORWARD, GRAD_FNS  # noqa: E402
from jaxformer.formats.hf_gpt2 import (HFFormatError, params_from_hf, read_hf_gpt2,  # noqa: E402
                                           write_hf_gpt2)
from manual_grads.check import assert_trees_close  # noqa: E402

jax.config.update("jax_enable_x64", True)
V, D, H, L, S = 97, 64, 4, 2, 32
B, T = 2, 13


def hf_model(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=D, n_head=H, n_layer=L, n_positions=S,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=V - 1,
                                  eos_token_id=V - 1, **overrides)
    cfg._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(cfg).double().eval()
    with torch.no_grad():  # every leaf random: zero biases or unit scales would hide errors
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.05) + (1.0 if "ln" in name and
                                                                             name.endswith("weight") else 0.0))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    model = hf_model()
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return {"inputs": jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32),
            "targets": jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)}


def test_import_matches_transformers_logits(saved):
    model, folder = saved
    params, config = read_hf_gpt2(folder, np.float64)
    assert (config.tie_embeddings, config.head_bias, config.activation) == (True, False, "gelu_tanh")
    assert "head" not in params
    b = batch()
    ours = np.asarray(FORWARD(params, b["inputs"], config))
    with torch.no_grad():
        ref = model(torch.tensor(np.asarray(b["inputs"]))).logits.numpy()
    np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-10 * np.abs(ref).max())


def test_gradients_match_torch_autograd(saved):
    model, folder = saved
    params, config = read_hf_gpt2(folder, np.float64)
    b = batch(1)
    model.zero_grad()
    logits = model(torch.tensor(np.asarray(b["inputs"]))).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), torch.tensor(np.asarray(b["targets"], np.int64)).reshape(-1))
    loss.backward()
    torch_grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    ref = params_from_hf(torch_grads, config, np.float64, "torch grads")
    loss_m, manual = GRAD_FNS["manual"](params, b, config)
    loss_a, auto = GRAD_FNS["jax.grad"](params, b, config)
    np.testing.assert_allclose([float(loss_m), float(loss_a)], loss.item(), rtol=1e-12)
    assert_trees_close(ref, manual)  # 1e-10 per leaf; tok_embed holds embedding + tied head
    assert_trees_close(ref, auto)


def test_export_reloads_in_transformers(saved, tmp_path):
    model, folder = saved
    params, config = read_hf_gpt2(folder, np.float64)
    params = jax.tree_util.tree_map(lambda a: a * 1.01, params)  # a "trained" model
    write_hf_gpt2(tmp_path / "out", params, config)
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out", attn_implementation="eager")
    back = back.double().eval()
    b = batch(2)
    ours = np.asarray(FORWARD(params, b["inputs"], config))
    with torch.no_grad():
        ref = back(torch.tensor(np.asarray(b["inputs"]))).logits.numpy()
    # the file holds float32: equal to float32 round-off
    np.testing.assert_allclose(ref, ours, rtol=1e-4, atol=1e-4 * np.abs(ours).max())
    again, config2 = read_hf_gpt2(tmp_path / "out", np.float64)
    assert config2 == config


def test_untied_and_torch_bin(tmp_path):
    model = hf_model(1, tie_word_embeddings=False)
    model.save_pretrained(tmp_path, safe_serialization=False)
    params, config = read_hf_gpt2(tmp_path, np.float64)
    assert not config.tie_embeddings and params["head"]["w"].shape == (D, V)
    b = batch()
    with torch.no_grad():
        ref = model(torch.tensor(np.asarray(b["inputs"]))).logits.numpy()
    np.testing.assert_allclose(FORWARD(params, b["inputs"], config), ref, rtol=1e-10,
                               atol=1e-10 * np.abs(ref).max())


def test_bad_folders_are_named(saved, tmp_path):
    _, folder = saved
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(HFFormatError, match="model_type 'llama'"):
        read_hf_gpt2(tmp_path)
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(folder / "model.safetensors"))
    cfg = (folder / "config.json").read_text()
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text(cfg)
    save_file({k: v for k, v in tensors.items() if "h.1.mlp.c_fc.bias" not in k}, str(missing / "model.safetensors"))
    with pytest.raises(HFFormatError, match="h.1.mlp.c_fc.bias.*missing"):
        read_hf_gpt2(missing)
    shaped = tmp_path / "shaped"
    shaped.mkdir()
    (shaped / "config.json").write_text(cfg)
    bad = dict(tensors)
    key = next(k for k in bad if k.endswith("wpe.weight"))
    bad[key] = bad[key][:5]
    save_file(bad, str(shaped / "model.safetensors"))
    with pytest.raises(HFFormatError, match="wpe.weight.*shape"):
        read_hf_gpt2(shaped)


# ---------------------------------------------------------------- the commands


def run_cli(*argv):
    from jaxformer.cli.main import main
    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def byte_gpt2(tmp_path_factory):
    """A random GPT-2 with the byte tokenizer's 256-token vocabulary, saved."""
    folder = tmp_path_factory.mktemp("hf256")
    torch.manual_seed(3)
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=32, n_head=4, n_layer=2, n_positions=32,
                                  bos_token_id=255, eos_token_id=255)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("grads", ["auto", "manual"])
def test_fine_tune_export_generate(byte_gpt2, corpus, tmp_path, grads, capsys):
    out = tmp_path / "ft"
    assert run_cli("train", "--init-from", byte_gpt2, "--grads", grads, "--steps", 4, "--seq-len", 32,
                   "--batch-size", 4, "--corpus", corpus, "--out", out, "--no-progress",
                   "--eval-every", 0, "--dropout", 0.1) == 0
    assert run_cli("export", "--run", out, "--hf", tmp_path / "hf") == 0
    params, config = read_hf_gpt2(tmp_path / "hf", np.float32)
    assert config.dropout == 0.0 and config.vocab_size == 256
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = np.arange(20, dtype=np.int64)[None] % 256
    with torch.no_grad():
        ref = back(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(FORWARD(params, jnp.asarray(ids, jnp.int32), config))
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # fine-tuning moved the weights away from the imported ones
    start, _ = read_hf_gpt2(byte_gpt2, np.float32)
    assert not np.allclose(start["tok_embed"], params["tok_embed"])
    assert run_cli("generate", "--run", out, "--prompt", "the", "--max-new-tokens", 5) == 0


def test_init_from_refuses_shape_flags_and_other_vocabularies(byte_gpt2, saved, corpus, tmp_path, capsys):
    assert run_cli("train", "--init-from", byte_gpt2, "--d-model", 64, "--steps", 1, "--seq-len", 16,
                   "--corpus", corpus, "--out", tmp_path / "a") == 2
    assert "--d-model" in capsys.readouterr().err
    # every field the weights fix, the newer ones too (one list: the fields that are not HOW_FIELDS)
    assert run_cli("train", "--init-from", byte_gpt2, "--head-dim", 8, "--no-qkv-bias",
                   "--steps", 1, "--seq-len", 16, "--corpus", corpus, "--out", tmp_path / "a") == 2
    err = capsys.readouterr().err
    assert "--head-dim, --qkv-bias would change it" in err and "Traceback" not in err, err
    # compare-grads alike, while a flag of how it is computed (--loss-chunk) passes
    assert run_cli("compare-grads", "--init-from", byte_gpt2, "--rope-theta", 500000,
                   "--out", tmp_path / "cmp") == 2
    assert "--rope-theta would change it" in capsys.readouterr().err
    _, folder97 = saved  # vocabulary 97, the byte tokenizer has 256
    assert run_cli("train", "--init-from", folder97, "--steps", 1, "--seq-len", 16,
                   "--corpus", corpus, "--out", tmp_path / "b", "--no-progress") != 0
    assert "vocabulary has 97 tokens" in capsys.readouterr().err
    assert run_cli("train", "--init-from", tmp_path / "nowhere-xyz", "--steps", 1,
                   "--corpus", corpus, "--out", tmp_path / "c") != 0
    assert "nowhere-xyz" in capsys.readouterr().err


def test_compare_grads_on_imported_weights(byte_gpt2, tmp_path, capsys):
    assert run_cli("compare-grads", "--init-from", byte_gpt2, "--batch-size", 2, "--seq-len", 16,
                   "--repeats", 1, "--loss-chunk", 8, "--out", tmp_path / "cmp") == 0
    assert "hf:" in capsys.readouterr().out
