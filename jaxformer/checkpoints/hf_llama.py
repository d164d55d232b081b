"""Hugging Face Llama folders (``LlamaForCausalLM``) in and out: config.json + safetensors
(one file or sharded), or ``pytorch_model.bin`` read with torch.

    read_hf_llama(folder, dtype) -> (params, ModelConfig)
    write_hf_llama(folder, params, config)     a folder LlamaForCausalLM.from_pretrained loads

The mapping, per layer l ("model." prefix; nn.Linear stores (out, in), our ``x @ w`` reads
(in, out), so every projection is transposed):

    model.embed_tokens.weight (V, D)                   tok_embed
    model.layers.l.input_layernorm.weight (D,)         blocks.ln1.scale
    model.layers.l.self_attn.q_proj.weight (H Dh, D)   blocks.attn.wq (D, H Dh) = its ^T
    model.layers.l.self_attn.k_proj.weight (Hkv Dh, D) blocks.attn.wk (D, Hkv Dh) = its ^T
    model.layers.l.self_attn.v_proj.weight (Hkv Dh, D) blocks.attn.wv = its ^T
    model.layers.l.self_attn.o_proj.weight (D, H Dh)   blocks.attn.wo = its ^T
    model.layers.l.post_attention_layernorm.weight     blocks.ln2.scale
    model.layers.l.mlp.gate_proj.weight (F, D)         blocks.ffn.w_gate (D, F) = its ^T
    model.layers.l.mlp.up_proj.weight (F, D)           blocks.ffn.w_up = its ^T
    model.layers.l.mlp.down_proj.weight (D, F)         blocks.ffn.w_down (F, D) = its ^T
    model.norm.weight (D,)                             ln_f.scale
    lm_head.weight (V, D)                              head.w = its ^T; tied: not stored (tok_embed)

With ``attention_bias`` and ``mlp_bias`` (both or neither: ModelConfig.bias covers both) the
projections' ``.bias`` map to bq bk bv bo and b_gate b_up b_down. The rotary layout is the
one transformers stores (rotate-half: feature i pairs with i + Dh/2, rotary.py), so q_proj
and k_proj load with no permutation. ``rotary_emb.inv_freq`` buffers some older files carry
are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxformer.checkpoints.hf_files import (CONFIG_JSON, SAFETENSORS, HFFormatError,
                                            read_config_json, read_tensors)
from jaxformer.model.config import ModelConfig

# hidden_act -> activation of the gated MLP (silu: SwiGLU; the gelus: GeGLU)
ACTIVATIONS_IN = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                  "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "tanh": "tanh", "relu2": "relu2"}
ACTIVATIONS_OUT = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu",
                   "tanh": "tanh", "relu2": "relu2"}
BUFFERS = (".rotary_emb.inv_freq",)
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
OURS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
        "gate_proj": "_gate", "up_proj": "_up", "down_proj": "_down"}  # w + suffix, b + suffix


def rope_theta_from_hf(hf: dict) -> float:
    """The rotary base of a Llama config.json: transformers 5's ``rope_parameters``
    {"rope_type", "rope_theta"} or the older top-level ``rope_theta`` and ``rope_scaling``.
    Any rope type but "default" (llama3, linear, dynamic, yarn, ...) is refused by name."""
    theta = hf.get("rope_theta", 10000.0)
    for key in ("rope_scaling", "rope_parameters"):
        rope = hf.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise HFFormatError(f"config.json: {key} {rope!r} is not a dict")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise HFFormatError(f"config.json: {key} rope_type {kind!r} is not supported "
                                f"(only 'default' rotary positions)")
        theta = rope.get("rope_theta", theta)
    return float(theta)


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
        return ModelConfig(
            vocab_size=hf["vocab_size"], d_model=D, n_heads=H, n_kv_heads=0 if n_kv == H else n_kv,
            n_layers=hf["num_hidden_layers"], d_ff=hf["intermediate_size"],
            max_seq_len=hf.get("max_position_embeddings", 2048), activation=ACTIVATIONS_IN[act],
            norm="pre", norm_type="rms", positions="rope", rope_theta=rope_theta_from_hf(hf),
            mlp="gated", causal=True, ln_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), bias=attention_bias,
            head_bias=False)
    except HFFormatError:
        raise
    except KeyError as e:
        raise HFFormatError(f"config.json: {e.args[0]!r} is missing") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise HFFormatError(f"config.json: {e}") from None


def config_to_hf(config: ModelConfig) -> dict:
    """config.json for ``config``; ValueError naming the option a Llama cannot have."""
    for name, want in (("norm", "pre"), ("norm_type", "rms"), ("norm_scale", True),
                       ("positions", "rope"), ("mlp", "gated"), ("causal", True), ("qk_norm", False),
                       ("embed_scale", False), ("head_bias", False)):
        if getattr(config, name) != want:
            raise ValueError(f"a Hugging Face Llama needs ModelConfig.{name} = {want!r}, "
                             f"this model has {getattr(config, name)!r}")
    if config.activation not in ACTIVATIONS_OUT:
        raise ValueError(f"a Hugging Face Llama needs ModelConfig.activation one of "
                         f"{', '.join(ACTIVATIONS_OUT)}, this model has {config.activation!r}")
    theta = config.rope_theta
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "vocab_size": config.vocab_size, "hidden_size": config.d_model,
            "intermediate_size": config.d_ff, "num_attention_heads": config.n_heads,
            "num_key_value_heads": config.kv_heads, "num_hidden_layers": config.n_layers,
            "head_dim": config.d_head, "max_position_embeddings": config.max_seq_len,
            "rms_norm_eps": config.ln_eps, "hidden_act": ACTIVATIONS_OUT[config.activation],
            # both spellings: transformers 5 reads rope_parameters, 4.x rope_theta / rope_scaling
            "rope_theta": theta, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "tie_word_embeddings": config.tie_embeddings,
            "attention_bias": config.bias, "mlp_bias": config.bias, "attention_dropout": 0.0,
            "dtype": "float32", "torch_dtype": "float32"}


def read_hf_llama(folder, dtype=np.float32) -> tuple[dict, ModelConfig]:
    """(params in ``dtype``, ModelConfig) of the Hugging Face Llama in ``folder``."""
    config = config_from_hf(read_config_json(folder))
    return params_from_hf(read_tensors(folder), config, dtype, str(folder)), config


def params_from_hf(tensors: dict, config: ModelConfig, dtype=np.float32, where: str = "tensors") -> dict:
    """The params pytree of ``config`` from a Llama state dict {HF name: array} (the mapping
    in the module docstring); ``where`` names the source in errors."""
    raw = {k: v for k, v in tensors.items() if not k.endswith(BUFFERS)}
    V, D, F, L = config.vocab_size, config.d_model, config.d_ff, config.n_layers
    Dkv = config.kv_heads * config.d_head
    out_in = {"q_proj": (D, D), "k_proj": (Dkv, D), "v_proj": (Dkv, D), "o_proj": (D, D),
              "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F)}

    def get(name, shape):
        if name not in raw:
            raise HFFormatError(f"{where}: tensor {name!r} is missing")
        a = np.asarray(raw.pop(name), dtype)
        if a.shape != tuple(shape):
            raise HFFormatError(f"{where}: tensor {name!r} has shape {a.shape}, config.json needs {tuple(shape)}")
        return a

    def layers(suffix, shape, transpose=False):
        a = np.stack([get(f"model.layers.{l}.{suffix}", shape) for l in range(L)])
        return np.ascontiguousarray(a.transpose(0, 2, 1)) if transpose else a

    def linears(group, names):
        p = {}
        for name in names:
            p["w" + OURS[name]] = layers(f"{group}.{name}.weight", out_in[name], transpose=True)
            if config.bias:
                p["b" + OURS[name]] = layers(f"{group}.{name}.bias", out_in[name][:1])
        return p

    params = {
        "tok_embed": get("model.embed_tokens.weight", (V, D)),
        "blocks": {"ln1": {"scale": layers("input_layernorm.weight", (D,))},
                   "attn": linears("self_attn", ATTN),
                   "ln2": {"scale": layers("post_attention_layernorm.weight", (D,))},
                   "ffn": linears("mlp", MLP)},
        "ln_f": {"scale": get("model.norm.weight", (D,))},
    }
    if config.tie_embeddings:
        raw.pop("lm_head.weight", None)  # some files store the tied copy too
    else:
        params["head"] = {"w": np.ascontiguousarray(get("lm_head.weight", (V, D)).T)}
    if raw:
        raise HFFormatError(f"{where}: unexpected tensor(s) {', '.join(sorted(raw)[:5])}")
    return params


def write_hf_llama(folder, params, config: ModelConfig) -> Path:
    """Write ``params`` of a Llama-shaped ``config`` as config.json + model.safetensors
    (float32, the names LlamaForCausalLM.save_pretrained writes)."""
    from safetensors.numpy import save_file
    hf = config_to_hf(config)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    f32 = lambda a: np.ascontiguousarray(np.asarray(a, np.float32))  # noqa: E731
    b = params["blocks"]
    out = {"model.embed_tokens.weight": f32(params["tok_embed"]),
           "model.norm.weight": f32(params["ln_f"]["scale"])}
    for l in range(config.n_layers):
        h = f"model.layers.{l}."
        out[h + "input_layernorm.weight"] = f32(b["ln1"]["scale"][l])
        out[h + "post_attention_layernorm.weight"] = f32(b["ln2"]["scale"][l])
        for group, names, p in (("self_attn", ATTN, b["attn"]), ("mlp", MLP, b["ffn"])):
            for name in names:
                out[f"{h}{group}.{name}.weight"] = f32(np.asarray(p["w" + OURS[name]][l]).T)
                if config.bias:
                    out[f"{h}{group}.{name}.bias"] = f32(p["b" + OURS[name]][l])
    if not config.tie_embeddings:
        out["lm_head.weight"] = f32(np.asarray(params["head"]["w"]).T)
    save_file(out, str(folder / SAFETENSORS), metadata={"format": "pt"})
    (folder / CONFIG_JSON).write_text(json.dumps(hf, indent=2) + "\n")
    return folder
