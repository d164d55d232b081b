"""Hugging Face OLMo 2 and Gemma folders in and out: ``Olmo2ForCausalLM``, ``GemmaForCausalLM``,
``Gemma2ForCausalLM`` and ``Gemma3ForCausalLM`` (model_type gemma3_text), Llama-shaped
(hf_llama.py: the same projections, gated MLP and rotary layout) but with their own norms:

    olmo2        norm "output": x + norm(f(x)) (post_attention_layernorm, post_feedforward_layernorm
                 on the sublayers' outputs), QK-norm over all of q and of k (qk_norm_scope "projection")
    gemma        the pre layout, every RMS scale as (1 + w) (norm_offset 1), the embedding times
                 sqrt(hidden_size) (embed_scale), GeGLU with the tanh GELU
    gemma2       as gemma, the sandwich layout (four norms a block), the scores scaled by
                 query_pre_attn_scalar^(-1/2) (attn_scalar), the attention and final softcaps
    gemma3_text  as gemma2, with Gemma's per-head QK-norm (1 + w) and no softcaps by default

Gemma 2 and 3's sliding-window layers are ModelConfig.sliding_window and layer_types, as their
configuration classes read them (layer_types, else Gemma 2 alternating sliding and full, Gemma 3
five sliding to one full by sliding_window_pattern); Gemma 3's local rotary base
(rope_parameters sliding_attention, or rope_local_base_freq) is ModelConfig.rope_local_theta,
the full layers keeping rope_theta with their scaling. What a family lacks is one line naming
the key. The tables are hf_table.py's, as hf_llama.py's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxformer.formats.hf_files import (CONFIG_JSON, SAFETENSORS, HFFormatError, config_errors, read_config_json,
                                            read_tensors)
from jaxformer.formats.hf_llama import (ACTIVATIONS_IN, ACTIVATIONS_OUT, BUFFERS, HEAD, LINEARS, ROPE_UNREADABLE, _count,
                                            config_of_tensors, rope_from_hf, rope_to_hf)
from jaxformer.formats.hf_table import (Key, Tensor, check_fixed, fields_in, keys_out, params_in,
                                            params_out, read_count, read_flag)
from jaxformer.formats.hf_windows import window_width
from jaxformer.model.checks import is_number
from jaxformer.model.config import ModelConfig

_LAYER = "model.layers.{l}."
SLIDE, FULL = "sliding_attention", "full_attention"
_D = lambda c: (c.d_model,)  # noqa: E731
_ATTN = lambda c: c.linear_biases.qkv  # noqa: E731  attention_bias: q, k, v and o alike


def _qk_width(c, heads):
    return (heads * c.d_head,) if c.qk_norm_scope == "projection" else (c.d_head,)


def _norm(hf_name, ours):
    return Tensor(_LAYER + hf_name + ".weight", (f"blocks.{ours}.scale",), _D)


class Family(NamedTuple):
    name: str  # in messages
    architecture: str  # config.json's architectures
    norms: tuple  # ((HF layer norm name, our blocks leaf), ...)
    fixed: dict  # the ModelConfig fields the family always has
    activation_key: str  # where config.json names the MLP's activation


_GEMMA = dict(norm_type="rms", norm_scale=True, norm_offset=1.0, positions="rope", mlp="gated", causal=True,
              embed_scale=True, head_bias=False, rope_layers=())
_ONE_ROPE = dict(rope_local_theta=0.0)  # no rotary base by layer kind (Gemma 3 has one)
_NO_WINDOW = dict(sliding_window=0)  # no sliding layers (Gemma 2 and 3 have them)
_SANDWICH = (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln1_post"),
             ("pre_feedforward_layernorm", "ln2"), ("post_feedforward_layernorm", "ln2_post"))
FAMILIES = {
    "olmo2": Family("OLMo 2", "Olmo2ForCausalLM",
                    (("post_attention_layernorm", "ln1_post"), ("post_feedforward_layernorm", "ln2_post")),
                    dict(norm="output", norm_type="rms", norm_scale=True, norm_offset=0.0, positions="rope",
                         mlp="gated", causal=True, embed_scale=False, head_bias=False, qk_norm=True,
                         qk_norm_scope="projection", attn_scalar=0.0, attn_softcap=0.0,
                         logit_softcap=0.0, rope_layers=(), **_ONE_ROPE, **_NO_WINDOW), "hidden_act"),
    "gemma": Family("Gemma", "GemmaForCausalLM",
                    (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")),
                    dict(_GEMMA, norm="pre", qk_norm=False, attn_scalar=0.0, attn_softcap=0.0, logit_softcap=0.0,
                         **_ONE_ROPE, **_NO_WINDOW),
                    "hidden_act"),
    "gemma2": Family("Gemma 2", "Gemma2ForCausalLM", _SANDWICH,
                     dict(_GEMMA, norm="sandwich", qk_norm=False, **_ONE_ROPE),
                     "hidden_activation"),
    "gemma3_text": Family("Gemma 3", "Gemma3ForCausalLM", _SANDWICH,
                          dict(_GEMMA, norm="sandwich", qk_norm=True, qk_norm_scope="head"), "hidden_activation"),
}


def tensors_of(family: Family) -> tuple:
    """The family's table: Llama's projections (biases by attention_bias), its own norms."""
    return (
        Tensor("model.embed_tokens.weight", ("tok_embed",), lambda c: (c.vocab_size, c.d_model)),
        *(_norm(hf, ours) for hf, ours in family.norms),
        *(Tensor(f"{_LAYER}{name}.weight", (f"blocks.{group}.w{suffix}",), shape, transpose=True)
          for name, group, suffix, shape, _ in LINEARS),
        *(Tensor(f"{_LAYER}{name}.bias", (f"blocks.{group}.b{suffix}",), lambda c, s=shape: s(c)[:1], when=_ATTN)
          for name, group, suffix, shape, _ in LINEARS if group == "attn"),
        Tensor(_LAYER + "self_attn.q_norm.weight", ("blocks.attn.q_norm.scale",),
               lambda c: _qk_width(c, c.n_heads), when=lambda c: c.qk_norm),
        Tensor(_LAYER + "self_attn.k_norm.weight", ("blocks.attn.k_norm.scale",),
               lambda c: _qk_width(c, c.kv_heads), when=lambda c: c.qk_norm),
        Tensor("model.norm.weight", ("ln_f.scale",), _D),
        Tensor(HEAD, ("head.w",), lambda c: (c.vocab_size, c.d_model), transpose=True,
               when=lambda c: not c.tie_embeddings),
    )


def _keys(family: Family, tied_default: bool) -> tuple:
    act = family.activation_key
    return (Key("vocab_size", "vocab_size"), Key("hidden_size", "d_model"),
            Key("num_attention_heads", "n_heads"), Key("num_hidden_layers", "n_layers"),
            Key("intermediate_size", "d_ff"), Key("max_position_embeddings", "max_seq_len", 2048),
            Key("rms_norm_eps", "ln_eps", 1e-6, float),
            Key(act, "activation", "gelu_pytorch_tanh" if act == "hidden_activation" else "silu",
                ACTIVATIONS_IN.__getitem__, ACTIVATIONS_OUT.__getitem__),
            Key("tie_word_embeddings", "tie_embeddings", tied_default))


def _number(hf: dict, key: str, default: float) -> float:
    """config.json's positive number ``key`` (null or absent: ``default``); one line naming it otherwise."""
    value = hf.get(key)
    if value is None:
        return default
    if not is_number(value) or value <= 0:
        raise HFFormatError(f"config.json: {key} must be a positive number, got {value!r}")
    return float(value)


def _gemma_windows(hf: dict, n_layers: int, pattern: int) -> dict:
    """Gemma 2 / 3's sliding layers, as their configuration classes: layer_types as given, or
    every ``pattern``-th layer full and the others sliding (Gemma 2: 2; Gemma 3:
    sliding_window_pattern, default 6); a null window is one that covers the sequence."""
    if read_flag(hf, "use_bidirectional_attention"):
        raise HFFormatError("config.json: use_bidirectional_attention true is not supported (a causal decoder only)")
    pattern = read_count("sliding_window_pattern", hf.get("sliding_window_pattern", pattern))
    types = hf.get("layer_types") or [FULL if (i + 1) % pattern == 0 else SLIDE for i in range(n_layers)]
    if not (isinstance(types, list) and len(types) == n_layers and set(types) <= {SLIDE, FULL}):
        raise HFFormatError(f"config.json: layer_types must list {n_layers} entries (num_hidden_layers), each "
                            f"{SLIDE!r} or {FULL!r}, got {types!r}")
    window = window_width(hf) or hf.get("max_position_embeddings", 2048)
    return {"sliding_window": int(window), "layer_types": tuple(types)} if SLIDE in types else {}


def _gemma3_rope(hf: dict, sliding: bool) -> dict:
    """Gemma 3's rotary fields: the full layers' (rope_parameters full_attention, or rope_theta
    default 1M with rope_scaling), and the sliding layers' base rope_local_theta (rope_parameters
    sliding_attention, or rope_local_base_freq default 10k; unscaled, or the same as the full layers')."""
    rope = hf.get("rope_parameters")
    nested = isinstance(rope, dict) and "full_attention" in rope
    full = rope_from_hf({**hf, "rope_parameters": rope["full_attention"]} if nested
                        else {**hf, "rope_theta": hf.get("rope_theta", 1_000_000.0)})
    if not sliding:
        return full
    if nested and "sliding_attention" in rope:
        local = rope_from_hf({**hf, "rope_scaling": None, "rope_parameters": rope["sliding_attention"]})
        if local == full:
            return full
        if local["rope_scaling"] != "none":
            raise HFFormatError("config.json: rope_parameters sliding_attention: a scaled rotary on the sliding "
                                "layers apart from the full layers' is not supported (rope_type 'default' only)")
        return {**full, "rope_local_theta": local["rope_theta"]}
    return {**full, "rope_local_theta": _number(hf, "rope_local_base_freq", 10_000.0)}


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of an OLMo 2 or Gemma config.json; HFFormatError naming the key that has
    no equivalent here or a value of the wrong type."""
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        raise HFFormatError(f"config.json: model_type {kind!r} is not one of {', '.join(FAMILIES)}")
    family = FAMILIES[kind]
    act = hf.get(family.activation_key)
    if kind == "gemma" and act == "gelu":  # transformers reads Gemma's legacy "gelu" as the tanh GELU
        hf = {**hf, "hidden_act": "gelu_pytorch_tanh"}
    elif act is not None and act not in ACTIVATIONS_IN:
        raise HFFormatError(f"config.json: {family.activation_key} {act!r} is not one of {', '.join(ACTIVATIONS_IN)}")
    with config_errors(ROPE_UNREADABLE):
        fields = fields_in(_keys(family, kind != "olmo2"), hf)
        D, H = fields["d_model"], fields["n_heads"]
        head_dim = D // H if kind == "olmo2" else _count(hf, "head_dim", D // H)
        n_kv = _count(hf, "num_key_value_heads", H)
        own = {}
        if kind in ("gemma2", "gemma3_text"):
            own = _gemma_windows(hf, fields["n_layers"], 2 if kind == "gemma2" else 6)
            scalar = _number(hf, "query_pre_attn_scalar", 256.0)
            own.update(attn_scalar=0.0 if scalar == head_dim else scalar,
                       attn_softcap=_number(hf, "attn_logit_softcapping", 0.0),
                       logit_softcap=_number(hf, "final_logit_softcapping", 0.0))
        rope = _gemma3_rope(hf, "layer_types" in own) if kind == "gemma3_text" else rope_from_hf(hf)
        biases = read_flag(hf, "attention_bias")
    keys = {**{key.ours: key.hf for key in _keys(family, kind != "olmo2")}, "n_kv_heads": "num_key_value_heads",
            "head_dim": "head_dim", "attn_scalar": "query_pre_attn_scalar", "attn_softcap": "attn_logit_softcapping",
            "logit_softcap": "final_logit_softcapping", "sliding_window": "sliding_window"}
    with config_errors(keys=keys):
        return ModelConfig(**fields, **{**family.fixed, **own}, family=kind,
                           head_dim=0 if D % H == 0 and head_dim == D // H else head_dim,
                           n_kv_heads=0 if n_kv == H else n_kv, **rope,
                           bias=biases, qkv_bias=biases, out_bias=biases, mlp_bias=False)


def config_to_hf(config: ModelConfig) -> dict:
    """config.json of ``config`` as its family (config.family); ValueError naming the option the
    family cannot hold."""
    family = FAMILIES[config.family]
    fixed = {k: v for k, v in family.fixed.items() if k not in ("attn_scalar", "attn_softcap", "logit_softcap")
             or config.family in ("olmo2", "gemma")}
    check_fixed(fixed, config, family.name)
    b = config.linear_biases
    for name, have, need in (("out_bias", b.out, b.qkv), ("mlp_bias", b.mlp, False)):
        if have != need:
            raise ValueError(f"a Hugging Face {family.name} needs ModelConfig.{name} = {need!r} (attention_bias "
                             f"covers q, k, v and o; no MLP bias), this model has {have!r}")
    if config.activation not in ACTIVATIONS_OUT:
        raise ValueError(f"a Hugging Face {family.name} needs ModelConfig.activation one of "
                         f"{', '.join(ACTIVATIONS_OUT)}, this model has {config.activation!r}")
    hf = {"model_type": config.family, "architectures": [family.architecture],
          **keys_out(_keys(family, True), config), "num_key_value_heads": config.kv_heads,
          "attention_bias": b.qkv, "attention_dropout": 0.0, **rope_to_hf(config),
          "dtype": "float32", "torch_dtype": "float32"}
    if config.family != "olmo2":
        hf["head_dim"] = config.d_head
    if config.family in ("gemma2", "gemma3_text"):
        scalar = config.attn_scalar or config.d_head  # transformers' field is an int
        hf.update(query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                  attn_logit_softcapping=config.attn_softcap or None,
                  final_logit_softcapping=config.logit_softcap or None,
                  sliding_window=config.sliding_window or config.max_seq_len,
                  layer_types=[SLIDE if w else FULL for w in config.windowed_layers])
    if config.family == "gemma3_text":
        rope = hf["rope_parameters"]
        local = {"rope_type": "default", "rope_theta": config.rope_local_theta} if config.rope_local_theta else rope
        hf["rope_parameters"] = {"full_attention": rope, "sliding_attention": dict(local)}
        hf["rope_local_base_freq"] = local["rope_theta"]
    return hf


def read_hf_olmo_gemma(folder, dtype=np.float32) -> tuple[dict, ModelConfig]:
    """(params in ``dtype``, ModelConfig) of the Hugging Face OLMo 2 or Gemma model in ``folder``."""
    config = config_from_hf(read_config_json(folder))
    tensors = read_tensors(folder)
    config = config_of_tensors(config, tensors)
    return params_from_hf(tensors, config, dtype, str(folder)), config


def params_from_hf(tensors: dict, config: ModelConfig, dtype=np.float32, where: str = "tensors") -> dict:
    """The params pytree of ``config`` (its family's table) from a state dict {HF name: array}."""
    raw = {k: v for k, v in tensors.items() if not k.endswith(BUFFERS)}
    if config.tie_embeddings:
        raw.pop(HEAD, None)
    return params_in(tensors_of(FAMILIES[config.family]), raw, config, dtype, where)


def write_hf_olmo_gemma(folder, params, config: ModelConfig) -> Path:
    """Write ``params`` as config.json + model.safetensors (float32) of config.family."""
    from safetensors.numpy import save_file
    hf = config_to_hf(config)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(params_out(tensors_of(FAMILIES[config.family]), params, config), str(folder / SAFETENSORS),
              metadata={"format": "pt"})
    (folder / CONFIG_JSON).write_text(json.dumps(hf, indent=2) + "\n")
    return folder
