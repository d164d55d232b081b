"""LoRA adapters in PEFT's format, against peft and transformers themselves (float64, nothing
downloaded): adapters saved by jaxformer load with ``peft.PeftModel.from_pretrained`` onto a
tiny random LlamaForCausalLM and give jaxformer's logits (1e-10 relative, the reference's norms
and rotary tables in float64 as in test_hf_llama); a PEFT folder reads back to the same tree;
a LoRA fine-tune through the commands (train --init-from --lora-rank, export --peft, export --hf
--merge) ends in folders that peft and transformers load with the run's logits."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_compare import assert_logits_equal, batch, random_folder, torch_logits  # noqa: E402
from test_hf_llama import float64_llama, llama_config, run_cli  # noqa: E402

import jaxformer  # noqa: E402
from jaxformer.formats.hf import read_hf  # noqa: E402
from jaxformer.formats.hf_files import HFFormatError  # noqa: E402
from jaxformer.formats.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_peft, save_peft  # noqa: E402
from jaxformer.model import lora  # noqa: E402

jax.config.update("jax_enable_x64", True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random grouped-query Llama (2 key/value heads of 4), untied, with the byte vocabulary."""
    return random_folder(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM",
                         llama_config(vocab_size=256, num_key_value_heads=2, tie_word_embeddings=False), 5)


def trained_adapters(params, lc, seed=1):
    ad = lora.init_adapters(jax.random.PRNGKey(seed), params, lc)
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda a: a + 0.3 * jnp.asarray(rng.standard_normal(a.shape), a.dtype), ad)


def peft_logits(base_folder, adapter_folder, ids):
    model = peft.PeftModel.from_pretrained(float64_llama(base_folder), str(adapter_folder)).eval()
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids, np.int64))).logits.double().numpy()


def test_saved_adapter_loads_in_peft_with_the_same_logits(llama, tmp_path):
    params, config = read_hf(llama, np.float64)
    lc = lora.LoraConfig(rank=3, alpha=7.0, targets="all")
    adapters = trained_adapters(params, lc)
    save_peft(tmp_path / "ad", adapters, lc, str(llama))
    names = set(__import__("safetensors.numpy", fromlist=["load_file"]).load_file(
        str(tmp_path / "ad" / ADAPTER_WEIGHTS)))
    a = "base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"
    assert a in names and a.replace("lora_A", "lora_B") in names and len(names) == 2 * 7 * 2
    ids = batch()["inputs"] % 256
    ours = np.asarray(jaxformer.forward(lora.attach(params, adapters, lc), ids, config))
    plain = np.asarray(jaxformer.forward(params, ids, config))
    assert np.abs(ours - plain).max() > 1e-2  # the adapters matter
    assert_logits_equal(ours, peft_logits(llama, tmp_path / "ad", ids))
    back, lc2 = read_peft(tmp_path / "ad", config.n_layers, np.float64)
    assert lc2 == lora.LoraConfig(3, 7.0, 0.0, "q,k,v,o,gate,up,down")  # "all" of a gated model
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, jax.tree_util.tree_map(np.asarray, adapters))


def test_peft_folder_errors_are_named(llama, tmp_path):
    params, config = read_hf(llama, np.float64)
    lc = lora.LoraConfig(rank=2, targets="q,v")
    save_peft(tmp_path / "ad", trained_adapters(params, lc), lc)
    cfg = json.loads((tmp_path / "ad" / ADAPTER_CONFIG).read_text())
    (tmp_path / "ad" / ADAPTER_CONFIG).write_text(json.dumps({**cfg, "target_modules": ["q_proj", "lm_head"]}))
    with pytest.raises(HFFormatError, match="target module.s. lm_head have no jaxformer projection"):
        read_peft(tmp_path / "ad", config.n_layers)
    (tmp_path / "ad" / ADAPTER_CONFIG).write_text(json.dumps({**cfg, "target_modules": ["q_proj", "k_proj"]}))
    with pytest.raises(HFFormatError, match="k_proj.lora_A.weight' is missing"):
        read_peft(tmp_path / "ad", config.n_layers)


def test_lora_fine_tune_peft_and_merged_export(llama, corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert run_cli("train", "--init-from", llama, "--lora-rank", 4, "--lora-alpha", 8, "--lora-targets",
                   "q,v,down", "--grads", "manual", "--steps", 4, "--seq-len", 16, "--batch-size", 4,
                   "--corpus", corpus, "--out", run, "--no-progress", "--eval-every", 0, "--lr", "0.01") == 0
    capsys.readouterr()
    assert run_cli("export", "--run", run, "--hf", tmp_path / "plain") == 2  # a LoRA run needs --merge
    assert "--merge" in capsys.readouterr().err
    assert run_cli("export", "--run", run, "--peft", tmp_path / "ad", "--hf", tmp_path / "merged", "--merge") == 0
    base, config = read_hf(llama, np.float64)
    adapters, lc = read_peft(tmp_path / "ad", config.n_layers, np.float64)
    assert lc == lora.LoraConfig(4, 8.0, 0.0, ("q", "v", "down"))
    ids = np.arange(20)[None] % 256
    ours = np.asarray(jaxformer.forward(lora.attach(base, adapters, lc), jnp.asarray(ids), config))
    assert np.abs(ours - np.asarray(jaxformer.forward(base, jnp.asarray(ids), config))).max() > 1e-4  # trained
    assert_logits_equal(ours, peft_logits(llama, tmp_path / "ad", ids))
    merged, config2 = read_hf(tmp_path / "merged", np.float64)
    assert config2 == config
    # the merged file holds float32: transformers' logits equal ours to float32's round-off
    assert_logits_equal(ours, torch_logits(float64_llama(tmp_path / "merged"), ids), rtol=1e-5)
