"""Hugging Face GPT-2 folders in and out: ``config.json`` + ``model.safetensors``
(or ``pytorch_model.bin``, read with torch when it is installed).

    read_hf_gpt2(folder, dtype) -> (params, ModelConfig)
    write_hf_gpt2(folder, params, config)      a folder GPT2LMHeadModel.from_pretrained loads

The mapping, per layer l (HF names with or without the "transformer." prefix):

    wte.weight (V, D)                  tok_embed
    wpe.weight (n_positions, D)        pos_embed
    h.l.ln_1.weight / .bias            blocks.ln1.scale / .bias
    h.l.attn.c_attn.weight (D, 3D)     [wq | wk | wv]: Conv1D keeps (in, out), as our x @ w
    h.l.attn.c_attn.bias (3D,)         [bq | bk | bv]
    h.l.attn.c_proj.weight / .bias     blocks.attn.wo / bo
    h.l.ln_2.weight / .bias            blocks.ln2.scale / .bias
    h.l.mlp.c_fc.weight / .bias        blocks.ffn.w_in / b_in
    h.l.mlp.c_proj.weight / .bias      blocks.ffn.w_out / b_out
    ln_f.weight / .bias                ln_f.scale / .bias
    lm_head.weight (V, D)              tied to wte (tie_embeddings, no head bias); untied: head.w = its ^T

config.json: n_embd, n_head, n_layer, n_positions, vocab_size, n_inner (None: 4 n_embd),
layer_norm_epsilon, activation_function (gelu_new and gelu_pytorch_tanh = gelu_tanh,
gelu, relu, tanh). The attn.bias / attn.masked_bias buffers some files carry are
the causal mask, not parameters: they are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxformer.checkpoints.hf_files import (CONFIG_JSON, SAFETENSORS, HFFormatError,  # noqa: F401
                                            read_config_json, read_tensors, resolve_source)
from jaxformer.model.config import ModelConfig

ACTIVATIONS_IN = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                  "relu": "relu", "tanh": "tanh"}
ACTIVATIONS_OUT = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "tanh": "tanh"}
BUFFERS = (".attn.bias", ".attn.masked_bias")


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
    try:
        D = hf["n_embd"]
        return ModelConfig(
            vocab_size=hf["vocab_size"], d_model=D, n_heads=hf["n_head"], n_layers=hf["n_layer"],
            d_ff=hf.get("n_inner") or 4 * D, max_seq_len=hf["n_positions"],
            activation=ACTIVATIONS_IN[act], norm="pre", positions="learned", causal=True,
            ln_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)), bias=True, head_bias=False)
    except KeyError as e:
        raise HFFormatError(f"config.json: {e.args[0]!r} is missing") from None
    except (TypeError, ValueError) as e:
        raise HFFormatError(f"config.json: {e}") from None


def config_to_hf(config: ModelConfig) -> dict:
    """config.json for ``config``; ValueError naming the field a GPT-2 cannot have."""
    for name, want in (("norm", "pre"), ("positions", "learned"), ("causal", True), ("bias", True),
                       ("head_bias", False), ("embed_scale", False), ("norm_type", "layer"),
                       ("mlp", "plain"), ("qk_norm", False)):
        if getattr(config, name) != want:
            raise ValueError(f"a Hugging Face GPT-2 needs ModelConfig.{name} = {want!r}, "
                             f"this model has {getattr(config, name)!r}")
    if config.kv_heads != config.n_heads:
        raise ValueError(f"a Hugging Face GPT-2 has as many key/value heads as query heads; this "
                         f"model has n_kv_heads {config.n_kv_heads} of n_heads {config.n_heads}")
    if config.activation not in ACTIVATIONS_OUT:
        raise ValueError(f"a Hugging Face GPT-2 needs ModelConfig.activation one of "
                         f"{', '.join(ACTIVATIONS_OUT)}, this model has {config.activation!r}")
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
            "vocab_size": config.vocab_size, "n_embd": config.d_model, "n_head": config.n_heads,
            "n_layer": config.n_layers, "n_inner": config.d_ff, "n_positions": config.max_seq_len,
            "n_ctx": config.max_seq_len, "layer_norm_epsilon": config.ln_eps,
            "activation_function": ACTIVATIONS_OUT[config.activation],
            "tie_word_embeddings": config.tie_embeddings,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "bos_token_id": config.vocab_size - 1, "eos_token_id": config.vocab_size - 1}


def read_hf_gpt2(folder, dtype=np.float32) -> tuple[dict, ModelConfig]:
    """(params in ``dtype``, ModelConfig) of the Hugging Face GPT-2 in ``folder``."""
    config = config_from_hf(read_config_json(folder))
    return params_from_hf(read_tensors(folder), config, dtype, str(folder)), config


def params_from_hf(tensors: dict, config: ModelConfig, dtype=np.float32, where: str = "tensors") -> dict:
    """The params pytree of ``config`` from a GPT-2 state dict {HF name: array} (the
    mapping in the module docstring); ``where`` names the source in errors."""
    folder = where
    raw = {k.removeprefix("transformer."): v for k, v in tensors.items() if not k.endswith(BUFFERS)}
    V, D, F, L, S = (config.vocab_size, config.d_model, config.d_ff, config.n_layers, config.max_seq_len)

    def get(name, shape):
        if name not in raw:
            raise HFFormatError(f"{folder}: tensor {name!r} is missing")
        a = np.asarray(raw.pop(name), dtype)
        if a.shape != tuple(shape):
            raise HFFormatError(f"{folder}: tensor {name!r} has shape {a.shape}, config.json needs {tuple(shape)}")
        return a

    def layers(suffix, shape):
        return np.stack([get(f"h.{l}.{suffix}", shape) for l in range(L)])

    c_attn_w, c_attn_b = layers("attn.c_attn.weight", (D, 3 * D)), layers("attn.c_attn.bias", (3 * D,))
    wq, wk, wv = np.split(c_attn_w, 3, axis=2)
    bq, bk, bv = np.split(c_attn_b, 3, axis=1)
    params = {
        "tok_embed": get("wte.weight", (V, D)),
        "pos_embed": get("wpe.weight", (S, D)),
        "blocks": {
            "ln1": {"scale": layers("ln_1.weight", (D,)), "bias": layers("ln_1.bias", (D,))},
            "attn": {"wq": wq, "bq": bq, "wk": wk, "bk": bk, "wv": wv, "bv": bv,
                     "wo": layers("attn.c_proj.weight", (D, D)), "bo": layers("attn.c_proj.bias", (D,))},
            "ln2": {"scale": layers("ln_2.weight", (D,)), "bias": layers("ln_2.bias", (D,))},
            "ffn": {"w_in": layers("mlp.c_fc.weight", (D, F)), "b_in": layers("mlp.c_fc.bias", (F,)),
                    "w_out": layers("mlp.c_proj.weight", (F, D)), "b_out": layers("mlp.c_proj.bias", (D,))},
        },
        "ln_f": {"scale": get("ln_f.weight", (D,)), "bias": get("ln_f.bias", (D,))},
    }
    head = raw.pop("lm_head.weight", None)
    if not config.tie_embeddings:
        if head is None:
            raise HFFormatError(f"{folder}: tensor 'lm_head.weight' is missing (tie_word_embeddings is false)")
        if head.shape != (V, D):
            raise HFFormatError(f"{folder}: tensor 'lm_head.weight' has shape {head.shape}, needs {(V, D)}")
        params["head"] = {"w": np.asarray(head, dtype).T.copy()}
    if raw:
        raise HFFormatError(f"{folder}: unexpected tensor(s) {', '.join(sorted(raw)[:5])}")
    return params


def write_hf_gpt2(folder, params, config: ModelConfig) -> Path:
    """Write ``params`` of a GPT-2-shaped ``config`` as config.json + model.safetensors
    (float32, the "transformer." names GPT2LMHeadModel.save_pretrained writes)."""
    from safetensors.numpy import save_file
    hf = config_to_hf(config)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    f32 = lambda a: np.ascontiguousarray(np.asarray(a, np.float32))  # noqa: E731
    b = params["blocks"]
    out = {"transformer.wte.weight": f32(params["tok_embed"]),
           "transformer.wpe.weight": f32(params["pos_embed"]),
           "transformer.ln_f.weight": f32(params["ln_f"]["scale"]),
           "transformer.ln_f.bias": f32(params["ln_f"]["bias"])}
    a = b["attn"]
    for l in range(config.n_layers):
        h = f"transformer.h.{l}."
        out[h + "ln_1.weight"], out[h + "ln_1.bias"] = f32(b["ln1"]["scale"][l]), f32(b["ln1"]["bias"][l])
        out[h + "ln_2.weight"], out[h + "ln_2.bias"] = f32(b["ln2"]["scale"][l]), f32(b["ln2"]["bias"][l])
        out[h + "attn.c_attn.weight"] = f32(np.concatenate([a["wq"][l], a["wk"][l], a["wv"][l]], axis=1))
        out[h + "attn.c_attn.bias"] = f32(np.concatenate([a["bq"][l], a["bk"][l], a["bv"][l]]))
        out[h + "attn.c_proj.weight"], out[h + "attn.c_proj.bias"] = f32(a["wo"][l]), f32(a["bo"][l])
        out[h + "mlp.c_fc.weight"], out[h + "mlp.c_fc.bias"] = f32(b["ffn"]["w_in"][l]), f32(b["ffn"]["b_in"][l])
        out[h + "mlp.c_proj.weight"] = f32(b["ffn"]["w_out"][l])
        out[h + "mlp.c_proj.bias"] = f32(b["ffn"]["b_out"][l])
    if not config.tie_embeddings:
        out["lm_head.weight"] = f32(np.asarray(params["head"]["w"]).T)
    save_file(out, str(folder / SAFETENSORS), metadata={"format": "pt"})
    (folder / CONFIG_JSON).write_text(json.dumps(hf, indent=2) + "\n")
    return folder
