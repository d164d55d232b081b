"""Hugging Face Llama-shaped folders in and out: ``LlamaForCausalLM`` and the families that
differ from it only in biases, QK-norm, the head width and which layers slide or rotate (FAMILIES:
``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``SmolLM3ForCausalLM``); config.json + safetensors (one file or
sharded), or ``pytorch_model.bin`` read with torch.

    read_hf_llama(folder, dtype) -> (params, ModelConfig)
    write_hf_llama(folder, params, config)     a folder the family's class from_pretrained loads

The mapping is written once, as tables read in both directions (hf_table.py): TENSORS
(HF name, our leaf, shape, transform: nn.Linear stores (out, in), our ``x @ w`` reads
(in, out), so every projection and the untied lm_head are transposed; a tied head is not
stored) and KEYS (config.json key, ModelConfig field); FIXED is what every Llama is.

The projections' ``.bias`` map to bq bk bv, bo and b_gate b_up b_down where the family has
them (ModelConfig.linear_biases): Llama's ``attention_bias`` (q, k, v and o) and ``mlp_bias``;
Qwen 2.5's q, k, v always and nothing else; Qwen 3's ``attention_bias``; Mistral none.
``head_dim`` (Qwen 3: 128 whatever the width) is ModelConfig.head_dim; Qwen 3's per-head
``q_norm`` and ``k_norm`` are ModelConfig.qk_norm. Sliding windows are ModelConfig.sliding_window
and layer_types: Mistral's ``sliding_window`` on every layer; Qwen's ``use_sliding_window``,
``sliding_window``, ``max_window_layers`` and ``layer_types`` as their configuration classes read
them (Llama has none: exporting a windowed model as Llama is refused); SmolLM 3's ``no_rope_layers``
is ModelConfig.rope_layers (hf_windows.py). The ModelConfig remembers the family (``family``), which export writes. The rotary layout is the
one transformers stores (rotate-half: feature i pairs with i + Dh/2, rotary.py), so q_proj
and k_proj load with no permutation. ``rotary_emb.inv_freq`` buffers some older files carry
are skipped.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from jaxformer.formats.hf_files import (CONFIG_JSON, SAFETENSORS, HFFormatError, config_errors,
                                            read_config_json, read_tensors)
from jaxformer.formats.hf_table import (Key, Tensor, check_fixed, fields_in, keys_out, params_in,
                                            params_out, read_count, read_flag)
from jaxformer.formats.hf_windows import mistral_windows, qwen_windows, qwen_windows_out, smollm3_layers, smollm3_out
from jaxformer.model.checks import is_number
from jaxformer.model.config import LinearBiases, ModelConfig

# hidden_act -> activation of the gated MLP (silu: SwiGLU; the gelus: GeGLU)
ACTIVATIONS_IN = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                  "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "tanh": "tanh", "relu2": "relu2"}
ACTIVATIONS_OUT = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu",
                   "tanh": "tanh", "relu2": "relu2"}
BUFFERS = (".rotary_emb.inv_freq",)
HEAD = "lm_head.weight"


def _q(c):
    return c.n_heads * c.d_head


def _kv(c):
    return c.kv_heads * c.d_head


_QKV, _OUT, _MLP = (lambda c: c.linear_biases.qkv), (lambda c: c.linear_biases.out), (lambda c: c.linear_biases.mlp)
# the projections: (HF group.name, our group and suffix (w + suffix, b + suffix), HF (out, in),
# whether the config has its bias)
LINEARS = (
    ("self_attn.q_proj", "attn", "q", lambda c: (_q(c), c.d_model), _QKV),
    ("self_attn.k_proj", "attn", "k", lambda c: (_kv(c), c.d_model), _QKV),
    ("self_attn.v_proj", "attn", "v", lambda c: (_kv(c), c.d_model), _QKV),
    ("self_attn.o_proj", "attn", "o", lambda c: (c.d_model, _q(c)), _OUT),
    ("mlp.gate_proj", "ffn", "_gate", lambda c: (c.d_ff, c.d_model), _MLP),
    ("mlp.up_proj", "ffn", "_up", lambda c: (c.d_ff, c.d_model), _MLP),
    ("mlp.down_proj", "ffn", "_down", lambda c: (c.d_model, c.d_ff), _MLP),
)
_DH = lambda c: (c.d_head,)  # noqa: E731
_LAYER = "model.layers.{l}."
_D = lambda c: (c.d_model,)  # noqa: E731
# The mapping of the module docstring, read in both directions (hf_table.py); shapes of one
# HF tensor. nn.Linear stores (out, in): every projection and the head are transposed.
TENSORS = (
    Tensor("model.embed_tokens.weight", ("tok_embed",), lambda c: (c.vocab_size, c.d_model)),
    Tensor(_LAYER + "input_layernorm.weight", ("blocks.ln1.scale",), _D),
    Tensor(_LAYER + "post_attention_layernorm.weight", ("blocks.ln2.scale",), _D),
    *(Tensor(f"{_LAYER}{name}.weight", (f"blocks.{group}.w{suffix}",), shape, transpose=True)
      for name, group, suffix, shape, _ in LINEARS),
    *(Tensor(f"{_LAYER}{name}.bias", (f"blocks.{group}.b{suffix}",), lambda c, s=shape: s(c)[:1],
             when=has) for name, group, suffix, shape, has in LINEARS),
    Tensor(_LAYER + "self_attn.q_norm.weight", ("blocks.attn.q_norm.scale",), _DH, when=lambda c: c.qk_norm),
    Tensor(_LAYER + "self_attn.k_norm.weight", ("blocks.attn.k_norm.scale",), _DH, when=lambda c: c.qk_norm),
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
    Key("tie_word_embeddings", "tie_embeddings", False),
)
# ModelConfig field -> the config.json key it is read from, for messages (hf_files.file_keys)
FILE_KEYS = {**{key.ours: key.hf for key in KEYS}, "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
             "rope_theta": "rope_theta", "sliding_window": "sliding_window"}
# what every Llama-shaped family is, which config.json does not record (qk_norm: by family)
FIXED = {"norm": "pre", "norm_type": "rms", "norm_scale": True, "positions": "rope", "mlp": "gated",
         "causal": True, "embed_scale": False, "head_bias": False, "attn_softcap": 0.0, "logit_softcap": 0.0,
         "rope_local_theta": 0.0}


def _llama_biases(hf: dict) -> LinearBiases:
    attention = read_flag(hf, "attention_bias")
    return LinearBiases(attention, attention, read_flag(hf, "mlp_bias"))


class Family(NamedTuple):
    name: str  # in messages
    architecture: str  # config.json's architectures
    qk_norm: bool  # a per-head RMS norm on q and k (q_norm, k_norm)
    biases: Callable[[dict], LinearBiases]  # config.json -> which projections have biases
    windows: Callable[[dict, int], dict]  # (config.json, n_layers) -> sliding_window and layer_types fields
    out: Callable[[ModelConfig, LinearBiases], dict]  # its own config.json keys; refuses the biases it lacks


def _need(family: str, biases: LinearBiases, want: LinearBiases, why: str) -> None:
    for name, have, need in zip(("qkv_bias", "out_bias", "mlp_bias"), biases, want):
        if have != need:
            raise ValueError(f"a Hugging Face {family} needs ModelConfig.{name} = {need!r} ({why}), "
                             f"this model has {have!r}")


def _llama_out(c, b):
    _need("Llama", b, b._replace(out=b.qkv), "attention_bias covers q, k, v and o")
    if c.sliding_window:
        raise ValueError(f"a Hugging Face Llama has no sliding window, this model has ModelConfig.sliding_window "
                         f"{c.sliding_window}: set family 'mistral', 'qwen2' or 'qwen3'")
    return {"attention_bias": b.qkv, "mlp_bias": b.mlp}


def _mistral_out(c, b):
    _need("Mistral", b, LinearBiases(False, False, False), "it has no biases")
    if len(set(c.windowed_layers)) > 1:
        raise ValueError(f"a Hugging Face Mistral has one sliding window for every layer, this model's "
                         f"ModelConfig.layer_types mix them: {c.layer_types}; set family 'qwen2' or 'qwen3'")
    return {"sliding_window": c.sliding_window or None}


def _qwen2_out(c, b):
    _need("Qwen2", b, LinearBiases(True, False, False), "q, k, v biases only")
    return qwen_windows_out(c)


def _qwen3_out(c, b):
    _need("Qwen3", b, LinearBiases(b.qkv, b.qkv, False), "attention_bias covers q, k, v and o; no MLP bias")
    return {"attention_bias": b.qkv, **qwen_windows_out(c)}


def _smollm3_out(c, b):
    _need("SmolLM3", b, b._replace(out=b.qkv), "attention_bias covers q, k, v and o")
    return {"attention_bias": b.qkv, "mlp_bias": b.mlp, **smollm3_out(c)}


FAMILIES = {
    "llama": Family("Llama", "LlamaForCausalLM", False, _llama_biases, lambda hf, n: {}, _llama_out),
    "mistral": Family("Mistral", "MistralForCausalLM", False, lambda hf: LinearBiases(False, False, False),
                      mistral_windows, _mistral_out),
    "qwen2": Family("Qwen2", "Qwen2ForCausalLM", False, lambda hf: LinearBiases(True, False, False),
                    qwen_windows, _qwen2_out),
    "qwen3": Family("Qwen3", "Qwen3ForCausalLM", True,
                    lambda hf: LinearBiases(read_flag(hf, "attention_bias"), read_flag(hf, "attention_bias"), False),
                    qwen_windows, _qwen3_out),
    "smollm3": Family("SmolLM3", "SmolLM3ForCausalLM", False, _llama_biases, smollm3_layers, _smollm3_out),
}


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
# what a TypeError or ValueError while reading a config.json's values means (in the rotary's numbers)
ROPE_UNREADABLE = "rope_theta or rope_parameters cannot be read"


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
    theta_key = f"{key} rope_theta" if "rope_theta" in rope else "rope_theta"
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if not is_number(theta) or not theta > 0:
        raise HFFormatError(f"config.json: {theta_key} must be a positive number, got {theta!r}")
    fields = {"rope_theta": theta, "rope_scaling": ROPE_TYPES[kind]}
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
    """The ModelConfig of a Llama-shaped config.json (a dict; model_type one of FAMILIES);
    HFFormatError naming the key that has no equivalent here or a value of the wrong type."""
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        raise HFFormatError(f"config.json: model_type {kind!r} is not one of {', '.join(FAMILIES)}")
    family = FAMILIES[kind]
    act = hf.get("hidden_act", "silu")
    if act not in ACTIVATIONS_IN:
        raise HFFormatError(f"config.json: hidden_act {act!r} is not one of {', '.join(ACTIVATIONS_IN)}")
    with config_errors(ROPE_UNREADABLE):
        fields = fields_in(KEYS, hf)
        D, H = fields["d_model"], fields["n_heads"]
        windows = family.windows(hf, fields["n_layers"])
        head_dim = _count(hf, "head_dim", D // H)
        n_kv = _count(hf, "num_key_value_heads", H)
        qkv, out, mlp = family.biases(hf)
        rope = rope_from_hf(hf)
    with config_errors(keys=FILE_KEYS):
        return ModelConfig(**fields, **FIXED, qk_norm=family.qk_norm, family=kind,
                           head_dim=0 if D % H == 0 and head_dim == D // H else head_dim,
                           n_kv_heads=0 if n_kv == H else n_kv, **rope,
                           bias=qkv, qkv_bias=qkv, out_bias=out, mlp_bias=mlp, **windows)


def _count(hf: dict, key: str, default: int) -> int:
    """config.json's positive integer ``key`` (null or absent: ``default``); one line naming it otherwise."""
    value = hf.get(key)
    return default if value is None else read_count(key, value)


def config_to_hf(config: ModelConfig) -> dict:
    """config.json of ``config`` as its family (config.family, or Llama); ValueError naming the
    option the family cannot hold."""
    family = FAMILIES[config.family if config.family in FAMILIES else "llama"]
    check_fixed({**FIXED, "qk_norm": family.qk_norm, **({} if family.name == "SmolLM3" else {"rope_layers": ()})},
                config, family.name)
    if config.activation not in ACTIVATIONS_OUT:
        raise ValueError(f"a Hugging Face {family.name} needs ModelConfig.activation one of "
                         f"{', '.join(ACTIVATIONS_OUT)}, this model has {config.activation!r}")
    own = family.out(config, config.linear_biases)
    return {"model_type": config.family or "llama", "architectures": [family.architecture], **keys_out(KEYS, config),
            "num_key_value_heads": config.kv_heads, "head_dim": config.d_head,
            **rope_to_hf(config),
            **own, "attention_dropout": 0.0, "dtype": "float32", "torch_dtype": "float32"}


def read_hf_llama(folder, dtype=np.float32) -> tuple[dict, ModelConfig]:
    """(params in ``dtype``, ModelConfig) of the Hugging Face Llama-shaped model in ``folder``."""
    config = config_from_hf(read_config_json(folder))
    tensors = read_tensors(folder)
    config = config_of_tensors(config, tensors)
    return params_from_hf(tensors, config, dtype, str(folder)), config


def config_of_tensors(config: ModelConfig, tensors: dict) -> ModelConfig:
    """``config`` untied where config.json ties the head but the folder stores an lm_head.weight
    that is not the embedding: transformers then keeps the stored head, untied, and so does this."""
    head, embed = tensors.get(HEAD), tensors.get("model.embed_tokens.weight")
    if config.tie_embeddings and head is not None and embed is not None and not (
            np.shape(head) == np.shape(embed) and np.array_equal(head, embed)):
        return config.replace(tie_embeddings=False)
    return config


def params_from_hf(tensors: dict, config: ModelConfig, dtype=np.float32, where: str = "tensors") -> dict:
    """The params pytree of ``config`` from a Llama-shaped state dict {HF name: array} (TENSORS);
    ``where`` names the source in errors. A tied model's lm_head.weight, if stored, is the
    embedding's copy (``config_of_tensors`` unties the config where it is not): skipped."""
    raw = {k: v for k, v in tensors.items() if not k.endswith(BUFFERS)}
    if config.tie_embeddings:
        raw.pop(HEAD, None)
    return params_in(TENSORS, raw, config, dtype, where)


def write_hf_llama(folder, params, config: ModelConfig) -> Path:
    """Write ``params`` of a Llama-shaped ``config`` as config.json + model.safetensors
    (float32, the names the family's save_pretrained writes)."""
    from safetensors.numpy import save_file
    hf = config_to_hf(config)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(params_out(TENSORS, params, config), str(folder / SAFETENSORS), metadata={"format": "pt"})
    (folder / CONFIG_JSON).write_text(json.dumps(hf, indent=2) + "\n")
    return folder
