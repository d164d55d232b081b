"""The presets shaped like public Hugging Face models (config.PRESETS: llama3.2-1b, mistral-7b,
qwen2.5-0.5b, qwen3-0.6b, olmo2-1b, gemma-2b, gemma2-2b, olmoe-1b-7b): each equals the ModelConfig
that the family's import (formats/hf_llama.py, hf_olmo_gemma.py, hf_moe.py) reads from the model's published
config.json, written out below with the keys the import reads; the counts are taken from shapes
only (jax.eval_shape), so no preset's weights are built."""

from __future__ import annotations

import math

import jax
import pytest

from jaxformer.formats import hf_llama, hf_moe, hf_olmo_gemma
from jaxformer.model.config import PRESET_TRAINING, PRESETS, SMALL_PRESETS
from jaxformer.model.params import init_params
from jaxformer.observe.flops import matmul_params

# huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json
LLAMA32_1B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_bias": False, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072,
    "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256,
}
# huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
MISTRAL_7B = {
    "model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": False, "vocab_size": 32000,
}
# huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json
QWEN25_05B = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 896,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
# huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json
QWEN3_06B = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936,
}
# huggingface.co/allenai/OLMo-2-0425-1B/blob/main/config.json
OLMO2_1B = {
    "model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], "attention_bias": False, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 4096, "num_attention_heads": 16,
    "num_hidden_layers": 16, "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 500000, "tie_word_embeddings": False, "vocab_size": 100352,
}
# huggingface.co/google/gemma-2b/blob/main/config.json
GEMMA_2B = {
    "model_type": "gemma", "architectures": ["GemmaForCausalLM"], "attention_bias": False, "head_dim": 256,
    "hidden_act": "gelu", "hidden_size": 2048, "intermediate_size": 16384, "max_position_embeddings": 8192,
    "num_attention_heads": 8, "num_hidden_layers": 18, "num_key_value_heads": 1, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "vocab_size": 256000,
}
# huggingface.co/google/gemma-2-2b/blob/main/config.json (tie_word_embeddings: Gemma2Config's default, true)
GEMMA2_2B = {
    "model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "attention_bias": False,
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
    "intermediate_size": 9216, "max_position_embeddings": 8192, "num_attention_heads": 8,
    "num_hidden_layers": 26, "num_key_value_heads": 4, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "sliding_window": 4096, "vocab_size": 256000,
}
# huggingface.co/allenai/OLMoE-1B-7B-0924/blob/main/config.json
OLMOE_1B_7B = {
    "model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "attention_bias": False, "clip_qkv": None,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 1024, "max_position_embeddings": 4096,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
    "num_hidden_layers": 16, "num_key_value_heads": 16, "output_router_logits": False, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
    "vocab_size": 50304,
}
LLAMA_SHAPED = {"llama3.2-1b": LLAMA32_1B, "mistral-7b": MISTRAL_7B, "qwen2.5-0.5b": QWEN25_05B,
                "qwen3-0.6b": QWEN3_06B}
OLMO_GEMMA = {"olmo2-1b": OLMO2_1B, "gemma-2b": GEMMA_2B}
FAMILY_PRESETS = (*LLAMA_SHAPED, *OLMO_GEMMA, "gemma2-2b")
# the published parameter counts (each model card), with the vocabulary of its config.json
PUBLISHED_BILLIONS = {"llama3.2-1b": 1.24, "mistral-7b": 7.24, "qwen2.5-0.5b": 0.49, "qwen3-0.6b": 0.6,
                      "olmo2-1b": 1.48, "gemma-2b": 2.51, "gemma2-2b": 2.61}


def n_params(config) -> int:
    shapes = jax.eval_shape(lambda: init_params(jax.random.PRNGKey(0), config))
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes))


@pytest.mark.parametrize("name", list(LLAMA_SHAPED))
def test_a_llama_shaped_preset_is_what_its_config_json_imports_as(name):
    assert PRESETS[name] == hf_llama.config_from_hf(LLAMA_SHAPED[name])


@pytest.mark.parametrize("name", list(OLMO_GEMMA))
def test_an_olmo_or_gemma_preset_is_what_its_config_json_imports_as(name):
    assert PRESETS[name] == hf_olmo_gemma.config_from_hf(OLMO_GEMMA[name])


def test_the_gemma2_preset_is_its_config_json_with_the_windows_of_transformers():
    """Gemma 2's import reads its alternating windows (layer i slides when i is even, as
    transformers' Gemma2Config writes layer_types), the published context kept."""
    assert PRESETS["gemma2-2b"] == hf_olmo_gemma.config_from_hf(GEMMA2_2B)
    assert PRESETS["gemma2-2b"].sliding_window == 4096 and PRESETS["gemma2-2b"].max_seq_len == 8192
    assert PRESETS["gemma2-2b"].windowed_layers[:3] == (True, False, True)


def test_the_olmoe_preset_is_its_config_json_with_the_load_balancing_loss_on():
    """OLMoE-1B-7B's import, its load-balancing loss turned on at router_aux_loss_coef (its
    output_router_logits false leaves it out of transformers' loss); 6.92B params, 1.28B
    active per token (the matmul weights of 8 of the 64 experts, and the embedding)."""
    config = PRESETS["olmoe-1b-7b"]
    imported = hf_moe.config_from_hf(OLMOE_1B_7B)
    assert imported.moe_aux_loss_coef == 0.0
    assert config == imported.replace(moe_aux_loss_coef=OLMOE_1B_7B["router_aux_loss_coef"])
    assert n_params(config) / 1e9 == pytest.approx(6.92, abs=0.011)
    assert (matmul_params(config) + config.vocab_size * config.d_model) / 1e9 == pytest.approx(1.28, abs=0.011)


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_each_family_preset_has_the_published_parameter_count_and_a_recipe(name):
    config = PRESETS[name]
    assert n_params(config) / 1e9 == pytest.approx(PUBLISHED_BILLIONS[name], abs=0.011)
    assert name not in SMALL_PRESETS and PRESET_TRAINING[name]["seq_len"] < config.max_seq_len
