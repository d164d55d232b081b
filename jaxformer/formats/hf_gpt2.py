"""Hugging Face GPT-2 folders in and out: ``config.json`` + ``model.safetensors``
(or ``pytorch_model.bin``, read with torch when it is installed).

    read_hf_gpt2(folder, dtype) -> (params, ModelConfig)
    write_hf_gpt2(folder, params, config)      a folder GPT2LMHeadModel.from_pretrained loads

The mapping is written once, as tables read in both directions (hf_table.py): TENSORS
(HF name, our leaves, shape, transform; names with or without the "transformer." prefix:
c_attn holds [wq | wk | wv], Conv1D keeps (in, out) as our x @ w, lm_head is tied to wte or
head.w^T) and KEYS (config.json key, ModelConfig field); FIXED is what every GPT-2 is.

config.json: n_embd, n_head, n_layer, n_positions, vocab_size, n_inner (None: 4 n_embd),
layer_norm_epsilon, activation_function (gelu_new and gelu_pytorch_tanh = gelu_tanh,
gelu, relu, tanh). The attn.bias / attn.masked_bias buffers some files carry are
the causal mask, not parameters: they are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxformer.formats.hf_files import (CONFIG_JSON, SAFETENSORS, HFFormatError, config_errors,  # noqa: F401
                                            read_config_json, read_tensors, resolve_source)
from jaxformer.formats.hf_table import Key, Tensor, check_fixed, fields_in, keys_out, params_in, params_out
from jaxformer.model.config import ModelConfig

ACTIVATIONS_IN = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                  "relu": "relu", "tanh": "tanh"}
ACTIVATIONS_OUT = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "tanh": "tanh"}
BUFFERS = (".attn.bias", ".attn.masked_bias")
PREFIX = "transformer."  # of every name but lm_head's, as save_pretrained writes them
HEAD = "lm_head.weight"

# The mapping of the module docstring, read in both directions (hf_table.py); shapes of one
# HF tensor. Conv1D keeps (in, out), as our x @ w: nothing is transposed but the head.
_D = lambda c: (c.d_model,)  # noqa: E731
TENSORS = (
    Tensor("wte.weight", ("tok_embed",), lambda c: (c.vocab_size, c.d_model)),
    Tensor("wpe.weight", ("pos_embed",), lambda c: (c.max_seq_len, c.d_model)),
    Tensor("h.{l}.ln_1.weight", ("blocks.ln1.scale",), _D),
    Tensor("h.{l}.ln_1.bias", ("blocks.ln1.bias",), _D),
    Tensor("h.{l}.attn.c_attn.weight", ("blocks.attn.wq", "blocks.attn.wk", "blocks.attn.wv"),
           lambda c: (c.d_model, 3 * c.d_model)),
    Tensor("h.{l}.attn.c_attn.bias", ("blocks.attn.bq", "blocks.attn.bk", "blocks.attn.bv"),
           lambda c: (3 * c.d_model,)),
    Tensor("h.{l}.attn.c_proj.weight", ("blocks.attn.wo",), lambda c: (c.d_model, c.d_model)),
    Tensor("h.{l}.attn.c_proj.bias", ("blocks.attn.bo",), _D),
    Tensor("h.{l}.ln_2.weight", ("blocks.ln2.scale",), _D),
    Tensor("h.{l}.ln_2.bias", ("blocks.ln2.bias",), _D),
    Tensor("h.{l}.mlp.c_fc.weight", ("blocks.ffn.w_in",), lambda c: (c.d_model, c.d_ff)),
    Tensor("h.{l}.mlp.c_fc.bias", ("blocks.ffn.b_in",), lambda c: (c.d_ff,)),
    Tensor("h.{l}.mlp.c_proj.weight", ("blocks.ffn.w_out",), lambda c: (c.d_ff, c.d_model)),
    Tensor("h.{l}.mlp.c_proj.bias", ("blocks.ffn.b_out",), _D),
    Tensor("ln_f.weight", ("ln_f.scale",), _D),
    Tensor("ln_f.bias", ("ln_f.bias",), _D),
    Tensor(HEAD, ("head.w",), lambda c: (c.vocab_size, c.d_model), transpose=True,
           when=lambda c: not c.tie_embeddings),
)
# config.json keys <-> ModelConfig fields (n_inner None: 4 n_embd)
KEYS = (
    Key("vocab_size", "vocab_size"), Key("n_embd", "d_model"), Key("n_head", "n_heads"),
    Key("n_layer", "n_layers"), Key("n_inner", "d_ff", None), Key("n_positions", "max_seq_len"),
    Key("layer_norm_epsilon", "ln_eps", 1e-5, float),
    Key("activation_function", "activation", "gelu_new", ACTIVATIONS_IN.__getitem__,
        ACTIVATIONS_OUT.__getitem__),
    Key("tie_word_embeddings", "tie_embeddings", True, bool),
)
# what every GPT-2 is, which config.json does not record
FIXED = {"norm": "pre", "positions": "learned", "causal": True, "bias": True, "head_bias": False,
         "embed_scale": False, "norm_type": "layer", "mlp": "plain", "qk_norm": False,
         "attn_softcap": 0.0, "logit_softcap": 0.0}


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of a GPT-2 config.json (a dict)."""
    if hf.get("model_type") != "gpt2":
        raise HFFormatError(f"config.json: model_type {hf.get('model_type')!r} is not 'gpt2'")
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS_IN:
        raise HFFormatError(f"config.json: activation_function {act!r} is not one of "
                            f"{', '.join(ACTIVATIONS_IN)}")
    for name, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                       ("add_cross_attention", False)):
        if hf.get(name, want) != want:
            raise HFFormatError(f"config.json: {name} = {hf[name]!r} is not supported (needs {want!r})")
    with config_errors(keys={key.ours: key.hf for key in KEYS}):
        fields = fields_in(KEYS, hf)
        fields["d_ff"] = fields["d_ff"] or 4 * fields["d_model"]
        return ModelConfig(**fields, **FIXED)


def config_to_hf(config: ModelConfig) -> dict:
    """config.json for ``config``; ValueError naming the field a GPT-2 cannot have."""
    check_fixed(FIXED, config, "GPT-2")
    if config.kv_heads != config.n_heads:
        raise ValueError(f"a Hugging Face GPT-2 has as many key/value heads as query heads; this "
                         f"model has n_kv_heads {config.n_kv_heads} of n_heads {config.n_heads}")
    if config.activation not in ACTIVATIONS_OUT:
        raise ValueError(f"a Hugging Face GPT-2 needs ModelConfig.activation one of "
                         f"{', '.join(ACTIVATIONS_OUT)}, this model has {config.activation!r}")
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], **keys_out(KEYS, config),
            "n_ctx": config.max_seq_len, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "bos_token_id": config.vocab_size - 1, "eos_token_id": config.vocab_size - 1}


def read_hf_gpt2(folder, dtype=np.float32) -> tuple[dict, ModelConfig]:
    """(params in ``dtype``, ModelConfig) of the Hugging Face GPT-2 in ``folder``."""
    config = config_from_hf(read_config_json(folder))
    return params_from_hf(read_tensors(folder), config, dtype, str(folder)), config


def params_from_hf(tensors: dict, config: ModelConfig, dtype=np.float32, where: str = "tensors") -> dict:
    """The params pytree of ``config`` from a GPT-2 state dict {HF name: array}, with or
    without the "transformer." prefix (TENSORS); ``where`` names the source in errors.
    A tied model's lm_head.weight, if stored, is the embedding's copy: skipped."""
    raw = {k.removeprefix(PREFIX): v for k, v in tensors.items() if not k.endswith(BUFFERS)}
    if config.tie_embeddings:
        raw.pop(HEAD, None)
    return params_in(TENSORS, raw, config, dtype, where)


def write_hf_gpt2(folder, params, config: ModelConfig) -> Path:
    """Write ``params`` of a GPT-2-shaped ``config`` as config.json + model.safetensors
    (float32, the "transformer." names GPT2LMHeadModel.save_pretrained writes)."""
    from safetensors.numpy import save_file
    hf = config_to_hf(config)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = {(k if k == HEAD else PREFIX + k): v for k, v in params_out(TENSORS, params, config).items()}
    save_file(out, str(folder / SAFETENSORS), metadata={"format": "pt"})
    (folder / CONFIG_JSON).write_text(json.dumps(hf, indent=2) + "\n")
    return folder
