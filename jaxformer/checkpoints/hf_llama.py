"""Hugging Face Llama folders (``LlamaForCausalLM``) in and out: config.json + safetensors
(one file or sharded), or ``pytorch_model.bin`` read with torch.

    read_hf_llama(folder, dtype) -> (params, ModelConfig)
    write_hf_llama(folder, params, config)     a folder LlamaForCausalLM.from_pretrained loads

The mapping is written once, as tables read in both directions (hf_table.py): TENSORS
(HF name, our leaf, shape, transform: nn.Linear stores (out, in), our ``x @ w`` reads
(in, out), so every projection and the untied lm_head are transposed; a tied head is not
stored) and KEYS (config.json key, ModelConfig field); FIXED is what every Llama is.

With ``attention_bias`` and ``mlp_bias`` (both or neither: ModelConfig.bias covers both) the
projections' ``.bias`` map to bq bk bv bo and b_gate b_up b_down. The rotary layout is the
one transformers stores (rotate-half: feature i pairs with i + Dh/2, rotary.py), so q_proj
and k_proj load with no permutation. ``rotary_emb.inv_freq`` buffers some older files carry
are skipped.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from jaxformer.checkpoints.hf_files import (CONFIG_JSON, SAFETENSORS, HFFormatError,
                                            read_config_json, read_tensors)
from jaxformer.checkpoints.hf_table import Key, Tensor, check_fixed, fields_in, keys_out, params_in, params_out
from jaxformer.model.config import ModelConfig

# hidden_act -> activation of the gated MLP (silu: SwiGLU; the gelus: GeGLU)
ACTIVATIONS_IN = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                  "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "tanh": "tanh", "relu2": "relu2"}
ACTIVATIONS_OUT = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu",
                   "tanh": "tanh", "relu2": "relu2"}
BUFFERS = (".rotary_emb.inv_freq",)
HEAD = "lm_head.weight"


def _kv(c):
    return c.kv_heads * c.d_head


# the projections: (HF group.name, our group and suffix (w + suffix, b + suffix), HF (out, in))
LINEARS = (
    ("self_attn.q_proj", "attn", "q", lambda c: (c.d_model, c.d_model)),
    ("self_attn.k_proj", "attn", "k", lambda c: (_kv(c), c.d_model)),
    ("self_attn.v_proj", "attn", "v", lambda c: (_kv(c), c.d_model)),
    ("self_attn.o_proj", "attn", "o", lambda c: (c.d_model, c.d_model)),
    ("mlp.gate_proj", "ffn", "_gate", lambda c: (c.d_ff, c.d_model)),
    ("mlp.up_proj", "ffn", "_up", lambda c: (c.d_ff, c.d_model)),
    ("mlp.down_proj", "ffn", "_down", lambda c: (c.d_model, c.d_ff)),
)
_LAYER = "model.layers.{l}."
_D = lambda c: (c.d_model,)  # noqa: E731
# The mapping of the module docstring, read in both directions (hf_table.py); shapes of one
# HF tensor. nn.Linear stores (out, in): every projection and the head are transposed.
TENSORS = (
    Tensor("model.embed_tokens.weight", ("tok_embed",), lambda c: (c.vocab_size, c.d_model)),
    Tensor(_LAYER + "input_layernorm.weight", ("blocks.ln1.scale",), _D),
    Tensor(_LAYER + "post_attention_layernorm.weight", ("blocks.ln2.scale",), _D),
    *(Tensor(f"{_LAYER}{name}.weight", (f"blocks.{group}.w{suffix}",), shape, transpose=True)
      for name, group, suffix, shape in LINEARS),
    *(Tensor(f"{_LAYER}{name}.bias", (f"blocks.{group}.b{suffix}",), lambda c, s=shape: s(c)[:1],
             when=lambda c: c.bias) for name, group, suffix, shape in LINEARS),
    Tensor("model.norm.weight", ("ln_f.scale",), _D),
    Tensor(HEAD, ("head.w",), lambda c: (c.vocab_size, c.d_model), transpose=True,
           when=lambda c: not c.tie_embeddings),
)
# config.json keys <-> ModelConfig fields; the rest (heads, rotary base, biases) are written
# out in config_from_hf and config_to_hf
KEYS = (
    Key("vocab_size", "vocab_size"), Key("hidden_size", "d_model"),
    Key("num_attention_heads", "n_heads"), Key("num_hidden_layers", "n_layers"),
    Key("intermediate_size", "d_ff"), Key("max_position_embeddings", "max_seq_len", 2048),
    Key("rms_norm_eps", "ln_eps", 1e-6, float),
    Key("hidden_act", "activation", "silu", ACTIVATIONS_IN.__getitem__, ACTIVATIONS_OUT.__getitem__),
    Key("tie_word_embeddings", "tie_embeddings", False, bool),
)
# what every Llama is, which config.json does not record
FIXED = {"norm": "pre", "norm_type": "rms", "norm_scale": True, "positions": "rope", "mlp": "gated",
         "causal": True, "qk_norm": False, "embed_scale": False, "head_bias": False}


# rope_type <-> ModelConfig.rope_scaling, and the numbers each scaling rule reads:
# (rope_parameters key, ModelConfig field, default where transformers has one)
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}
ROPE_NUMBERS = {
    "linear": (("factor", "rope_factor", None),),
    "llama3": (("factor", "rope_factor", None), ("low_freq_factor", "rope_low_freq_factor", None),
               ("high_freq_factor", "rope_high_freq_factor", None)),
    "yarn": (("factor", "rope_factor", None), ("beta_fast", "rope_beta_fast", 32.0),
             ("beta_slow", "rope_beta_slow", 1.0)),
}


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_from_hf(hf: dict) -> dict:
    """The rotary fields (rope_theta, rope_scaling, rope_*) of a Llama config.json: the older
    ``rope_scaling`` {"rope_type" | "type", "factor", ...} with a top-level ``rope_theta``, or
    transformers 5's ``rope_parameters`` {"rope_type", "rope_theta", ...} (rope_scaling first,
    as transformers reads them). A rope type other than default, linear, llama3 and yarn is
    refused by name."""
    key = "rope_scaling" if hf.get("rope_scaling") is not None else "rope_parameters"
    rope = hf.get(key) or {}
    if not isinstance(rope, dict):
        raise HFFormatError(f"config.json: {key} {rope!r} is not a dict")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise HFFormatError(f"config.json: {key} rope_type {kind!r} is not supported "
                            f"(supported: {', '.join(ROPE_TYPES)})")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise HFFormatError(f"config.json: partial_rotary_factor {rope.get('partial_rotary_factor')!r} "
                            "is not supported (every feature of a head is rotated here)")
    fields = {"rope_theta": rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
              "rope_scaling": ROPE_TYPES[kind]}
    if kind in ("llama3", "yarn"):
        fields["rope_original_max_len"] = (hf.get("original_max_position_embeddings")
                                           or rope.get("original_max_position_embeddings")
                                           or hf.get("max_position_embeddings", 2048))
    if kind == "yarn" and rope.get("factor") is None:  # transformers: the ratio of the two lengths
        rope = {**rope, "factor": hf.get("max_position_embeddings", 2048) / fields["rope_original_max_len"]}
    for name, field, default in ROPE_NUMBERS.get(kind, ()):
        value = rope.get(name) or default
        if value is None:
            raise HFFormatError(f"config.json: {key} rope_type {kind!r} needs {name!r}")
        fields[field] = value
    if kind == "yarn":
        fields["rope_truncate"] = rope.get("truncate", True)
        fields["rope_attention_factor"] = rope.get("attention_factor") or 0.0
        if not rope.get("attention_factor") and rope.get("mscale") and rope.get("mscale_all_dim"):
            fields["rope_attention_factor"] = (yarn_mscale(fields["rope_factor"], rope["mscale"])
                                               / yarn_mscale(fields["rope_factor"], rope["mscale_all_dim"]))
    return fields


def rope_to_hf(config: ModelConfig) -> dict:
    """config.json's rotary keys for ``config``: both spellings (transformers 5 reads
    rope_parameters, 4.x rope_theta and rope_scaling)."""
    kind = {ours: theirs for theirs, ours in ROPE_TYPES.items()}[config.rope_scaling]
    scaling = {"rope_type": kind}
    scaling.update({name: getattr(config, field) for name, field, _ in ROPE_NUMBERS.get(kind, ())})
    if kind in ("llama3", "yarn"):
        scaling["original_max_position_embeddings"] = config.rope_original_max_len
    if kind == "yarn":
        scaling["truncate"] = config.rope_truncate
        if config.rope_attention_factor:
            scaling["attention_factor"] = config.rope_attention_factor
    return {"rope_theta": config.rope_theta, "rope_scaling": None if kind == "default" else scaling,
            "rope_parameters": {**scaling, "rope_theta": config.rope_theta}}


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of a Llama config.json (a dict); HFFormatError naming what has no
    equivalent here."""
    if hf.get("model_type") != "llama":
        raise HFFormatError(f"config.json: model_type {hf.get('model_type')!r} is not 'llama'")
    act = hf.get("hidden_act", "silu")
    if act not in ACTIVATIONS_IN:
        raise HFFormatError(f"config.json: hidden_act {act!r} is not one of {', '.join(ACTIVATIONS_IN)}")
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise HFFormatError(f"config.json: attention_bias {attention_bias} with mlp_bias {mlp_bias} is not "
                            f"supported (ModelConfig.bias covers both: they must be equal)")
    try:
        D, H = hf["hidden_size"], hf["num_attention_heads"]
        if not isinstance(H, int) or H < 1:
            raise HFFormatError(f"config.json: num_attention_heads must be a positive integer, got {H!r}")
        head_dim = hf.get("head_dim") or D // H
        if D % H or head_dim != D // H:
            raise HFFormatError(f"config.json: head_dim {head_dim} is not hidden_size / "
                                f"num_attention_heads ({D} / {H}); only that head width is supported")
        n_kv = hf.get("num_key_value_heads") or H
        return ModelConfig(**fields_in(KEYS, hf), **FIXED, n_kv_heads=0 if n_kv == H else n_kv,
                           **rope_from_hf(hf), bias=attention_bias)
    except HFFormatError:
        raise
    except KeyError as e:
        raise HFFormatError(f"config.json: {e.args[0]!r} is missing") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise HFFormatError(f"config.json: {e}") from None


def config_to_hf(config: ModelConfig) -> dict:
    """config.json for ``config``; ValueError naming the option a Llama cannot have."""
    check_fixed(FIXED, config, "Llama")
    if config.activation not in ACTIVATIONS_OUT:
        raise ValueError(f"a Hugging Face Llama needs ModelConfig.activation one of "
                         f"{', '.join(ACTIVATIONS_OUT)}, this model has {config.activation!r}")
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **keys_out(KEYS, config),
            "num_key_value_heads": config.kv_heads, "head_dim": config.d_head, **rope_to_hf(config),
            "attention_bias": config.bias, "mlp_bias": config.bias, "attention_dropout": 0.0,
            "dtype": "float32", "torch_dtype": "float32"}


def read_hf_llama(folder, dtype=np.float32) -> tuple[dict, ModelConfig]:
    """(params in ``dtype``, ModelConfig) of the Hugging Face Llama in ``folder``."""
    config = config_from_hf(read_config_json(folder))
    return params_from_hf(read_tensors(folder), config, dtype, str(folder)), config


def params_from_hf(tensors: dict, config: ModelConfig, dtype=np.float32, where: str = "tensors") -> dict:
    """The params pytree of ``config`` from a Llama state dict {HF name: array} (TENSORS);
    ``where`` names the source in errors. A tied model's lm_head.weight, if stored, is the
    embedding's copy: skipped."""
    raw = {k: v for k, v in tensors.items() if not k.endswith(BUFFERS)}
    if config.tie_embeddings:
        raw.pop(HEAD, None)
    return params_in(TENSORS, raw, config, dtype, where)


def write_hf_llama(folder, params, config: ModelConfig) -> Path:
    """Write ``params`` of a Llama-shaped ``config`` as config.json + model.safetensors
    (float32, the names LlamaForCausalLM.save_pretrained writes)."""
    from safetensors.numpy import save_file
    hf = config_to_hf(config)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(params_out(TENSORS, params, config), str(folder / SAFETENSORS), metadata={"format": "pt"})
    (folder / CONFIG_JSON).write_text(json.dumps(hf, indent=2) + "\n")
    return folder
