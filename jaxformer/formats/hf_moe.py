"""Hugging Face mixture-of-experts folders in and out: ``MixtralForCausalLM``,
``Qwen3MoeForCausalLM``, ``OlmoeForCausalLM`` and ``Qwen2MoeForCausalLM``. Each is a dense family's block (attention,
norms, rotary, windows: read and written by hf_llama.py) with its feed-forward layer replaced
by the MoE layer of model/moe.py (ModelConfig.n_experts):

    mixtral    Mistral's attention (no biases, one sliding_window on every layer);
               router "topk_softmax" (transformers' softmax, top-k, renormalise: the softmax of
               the k largest logits); intermediate_size is each expert's width
    qwen3_moe  Qwen 3's attention (per-head QK-norm, attention_bias); sliding_window on every
               layer where use_sliding_window; router "softmax_topk" with norm_topk_prob;
               moe_intermediate_size is each expert's width (expert_d_ff), intermediate_size the
               dense MLP's (d_ff), which no layer uses: every layer must be an MoE one, so
               decoder_sparse_step other than 1 or a non-empty mlp_only_layers is refused by name
    olmoe      Llama's attention with OLMo's QK-norm over all of q and of k (qk_norm_scope
               "projection"), no window, clip_qkv null only; router "softmax_topk", norm_topk_prob
    qwen2_moe  Qwen 2's attention (q, k, v biases: qkv_bias true only), no window
               (use_sliding_window false only); router "softmax_topk", norm_topk_prob; the experts
               as qwen3_moe's (moe_intermediate_size; every layer MoE) and a shared expert of width
               shared_expert_intermediate_size with its sigmoid gate (shared_expert_d_ff,
               shared_expert_gate; model/shared_expert.py): ``mlp.shared_expert.gate_proj /
               up_proj / down_proj`` = blocks.ffn.shared.w_*^T, ``mlp.shared_expert_gate.weight``
               (1, D) = blocks.ffn.shared_gate^T

Tensors: the router ``gate.weight`` (E, D) is blocks.ffn.router^T; the experts are stored one
per expert as save_pretrained writes them (Mixtral ``block_sparse_moe.experts.{e}.w1 / w3 / w2``,
the others ``mlp.experts.{e}.gate_proj / up_proj / down_proj``, each nn.Linear's (out, in)), or
fused as transformers 5 holds them in memory (``mlp.experts.gate_up_proj`` (E, 2F, D) =
[w_gate | w_up]^T, ``mlp.experts.down_proj`` (E, D, F) = w_down^T); both are read, the first is
written.

The load-balancing loss: transformers adds ``router_aux_loss_coef`` times it to the loss only
when ``output_router_logits`` is true, so moe_aux_loss_coef is router_aux_loss_coef there and 0
otherwise; the export writes router_aux_loss_coef = moe_aux_loss_coef and output_router_logits
= (moe_aux_loss_coef > 0). The router z-loss has no key in these families: it is written as
``router_z_loss_coef`` (transformers keeps the key and ignores it) and read back from it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxformer.formats import hf_llama
from jaxformer.formats.hf_files import (CONFIG_JSON, SAFETENSORS, HFFormatError, config_errors, read_config_json,
                                           read_tensors)
from jaxformer.formats.hf_olmo_gemma import _qk_width
from jaxformer.formats.hf_table import Tensor, float_weight, params_in, params_out, read_flag
from jaxformer.formats.hf_windows import window_width
from jaxformer.model.checks import is_int, is_number
from jaxformer.model.config import ModelConfig

_LAYER = "model.layers.{l}."


class Family(NamedTuple):
    name: str  # in messages
    architecture: str  # config.json's architectures
    base: str  # the dense family (hf_llama.FAMILIES) whose attention and norms it has
    router: str  # ModelConfig.router
    experts_key: str  # config.json's number of experts
    moe: str  # the MoE block's module name in the stored state dict
    names: tuple  # the stored expert projections: (gate, up, down)


FAMILIES = {
    "mixtral": Family("Mixtral", "MixtralForCausalLM", "mistral", "topk_softmax", "num_local_experts",
                      "block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": Family("Qwen3-MoE", "Qwen3MoeForCausalLM", "qwen3", "softmax_topk", "num_experts", "mlp",
                        ("gate_proj", "up_proj", "down_proj")),
    "olmoe": Family("OLMoE", "OlmoeForCausalLM", "llama", "softmax_topk", "num_experts", "mlp",
                    ("gate_proj", "up_proj", "down_proj")),
    "qwen2_moe": Family("Qwen2-MoE", "Qwen2MoeForCausalLM", "qwen2", "softmax_topk", "num_experts", "mlp",
                        ("gate_proj", "up_proj", "down_proj")),
}
QWEN_MOE = ("qwen3_moe", "qwen2_moe")  # every layer MoE unless decoder_sparse_step / mlp_only_layers say not


def _positive(hf: dict, key: str, default=None) -> int:
    value = hf.get(key, default)
    if not (is_int(value) and value >= 1):
        raise HFFormatError(f"config.json: {key} must be a positive integer, got {value!r}")
    return int(value)


def _coef(hf: dict, key: str) -> float:
    value = hf.get(key) or 0.0
    if not (is_number(value) and value >= 0):
        raise HFFormatError(f"config.json: {key} must be a non-negative number, got {value!r}")
    return float(value)


def _all_layers_moe(hf: dict, n_layers: int) -> None:
    """Qwen2- and Qwen3-MoE's layers without experts (decoder_sparse_step, mlp_only_layers) refused by name."""
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if not (is_int(step) and step >= 1):
        raise HFFormatError(f"config.json: decoder_sparse_step must be a positive integer, got {step!r}")
    plain = sorted({l for l in range(n_layers) if l in dense or (l + 1) % step})
    if plain:
        raise HFFormatError(f"config.json: decoder_sparse_step {step} / mlp_only_layers {dense}: layers {plain} "
                            "have a dense MLP, not supported (every block here is an MoE one)")


def _dense_json(hf: dict, kind: str) -> dict:
    """config.json as its dense base family reads it (the MoE keys aside)."""
    dense = {**hf, "model_type": FAMILIES[kind].base}
    if kind == "qwen3_moe":  # the window goes on every layer, read below
        dense.update(use_sliding_window=False, layer_types=None)
    if kind == "qwen2_moe":  # no window (read below: only its absence)
        dense.update(use_sliding_window=False, layer_types=None)
    if kind == "olmoe":  # head_dim is hidden_size / heads; no MLP bias, no window
        dense = {k: v for k, v in dense.items() if k not in ("head_dim", "mlp_bias", "sliding_window")}
    return dense


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig of a Mixtral, Qwen3-MoE or OLMoE config.json; HFFormatError naming the
    key that has no equivalent here."""
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        raise HFFormatError(f"config.json: model_type {kind!r} is not one of {', '.join(FAMILIES)}")
    family = FAMILIES[kind]
    dense = hf_llama.config_from_hf(_dense_json(hf, kind))
    n_experts = _positive(hf, family.experts_key, hf.get("num_local_experts", hf.get("num_experts")))
    fields = dict(family=kind, n_experts=n_experts, experts_per_token=_positive(hf, "num_experts_per_tok"),
                  router=family.router, norm_topk_prob=read_flag(hf, "norm_topk_prob") if kind != "mixtral" else False,
                  moe_aux_loss_coef=_coef(hf, "router_aux_loss_coef") if read_flag(hf, "output_router_logits") else 0.0,
                  router_z_loss_coef=_coef(hf, "router_z_loss_coef"))
    if kind == "mixtral" and _coef(hf, "router_jitter_noise"):
        raise HFFormatError(f"config.json: router_jitter_noise {hf['router_jitter_noise']!r} is not supported "
                            "(the router takes no noise here; 0.0 only)")
    if kind in QWEN_MOE:
        _all_layers_moe(hf, dense.n_layers)
        fields["expert_d_ff"] = _positive(hf, "moe_intermediate_size", 768 if kind == "qwen3_moe" else 1408)
    if kind == "qwen2_moe":
        fields.update(_qwen2_moe_fields(hf))
    if kind == "qwen3_moe":
        if read_flag(hf, "use_sliding_window") and window_width(hf) is not None:
            fields["sliding_window"] = int(window_width(hf))
    if kind == "olmoe":
        if hf.get("clip_qkv") is not None:
            raise HFFormatError(f"config.json: clip_qkv {hf['clip_qkv']!r} is not supported (null only)")
        fields.update(qk_norm=True, qk_norm_scope="projection")
    with config_errors(keys={**hf_llama.FILE_KEYS, "n_experts": family.experts_key,
                             "experts_per_token": "num_experts_per_tok", "expert_d_ff": "moe_intermediate_size",
                             "shared_expert_d_ff": "shared_expert_intermediate_size"}):
        return dense.replace(**fields)


def _qwen2_moe_fields(hf: dict) -> dict:
    """The shared expert of a Qwen2-MoE config.json; its window and qkv_bias false refused by name."""
    if read_flag(hf, "use_sliding_window"):
        raise HFFormatError("config.json: use_sliding_window true is not supported for qwen2_moe (false only)")
    if hf.get("qkv_bias", True) is not True:
        raise HFFormatError(f"config.json: qkv_bias {hf['qkv_bias']!r} is not supported for qwen2_moe (true only)")
    return dict(shared_expert_d_ff=_positive(hf, "shared_expert_intermediate_size", 5632), shared_expert_gate=True)


def family_of(config: ModelConfig) -> str:
    """The family an MoE model without one exports as: a shared expert is "qwen2_moe";
    Mixtral's router "mixtral"; a QK-norm over the projection "olmoe"; else "qwen3_moe"
    (config_to_hf refuses what it cannot hold)."""
    if config.shared_expert_d_ff:
        return "qwen2_moe"
    if config.router == "topk_softmax":
        return "mixtral"
    return "olmoe" if config.qk_norm and config.qk_norm_scope == "projection" else "qwen3_moe"


def _refuse(config: ModelConfig, family: Family, field: str, want) -> None:
    if getattr(config, field) != want:
        raise ValueError(f"a Hugging Face {family.name} needs ModelConfig.{field} = {want!r}, "
                         f"this model has {getattr(config, field)!r}")


def config_to_hf(config: ModelConfig) -> dict:
    """config.json of the MoE ``config`` as config.family; ValueError naming the option the
    family cannot hold."""
    family = FAMILIES[config.family]
    _refuse(config, family, "router", family.router)
    _refuse(config, family, "moe_every", 1)
    if config.family != "qwen2_moe":
        _refuse(config, family, "shared_expert_d_ff", 0)
    dense = dict(family=family.base, n_experts=0, experts_per_token=2, expert_d_ff=0, router="topk_softmax",
                 norm_topk_prob=False, moe_aux_loss_coef=0.0, router_z_loss_coef=0.0, shared_expert_d_ff=0,
                 shared_expert_gate=True)
    own = {family.experts_key: config.n_experts, "num_experts_per_tok": config.experts_per_token,
           "router_aux_loss_coef": config.moe_aux_loss_coef, "output_router_logits": config.moe_aux_loss_coef > 0,
           "router_z_loss_coef": config.router_z_loss_coef}
    if config.family == "qwen3_moe":
        _refuse(config, family, "qk_norm_scope", "head")
        if len(set(config.windowed_layers)) > 1:
            raise ValueError(f"a Hugging Face Qwen3-MoE has one sliding window for every layer, this model's "
                             f"ModelConfig.layer_types mix them: {config.layer_types}")
        dense.update(sliding_window=0, layer_types=())
        own.update(moe_intermediate_size=config.expert_width, norm_topk_prob=config.norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=bool(config.sliding_window),
                   sliding_window=config.sliding_window or None)
    elif config.family == "qwen2_moe":
        own.update(_qwen2_moe_out(config, family))
    else:
        dense["d_ff"] = config.expert_width  # intermediate_size is each expert's width
    if config.family == "mixtral":
        own["router_jitter_noise"] = 0.0
    if config.family == "olmoe":
        _refuse(config, family, "qk_norm", True)
        _refuse(config, family, "qk_norm_scope", "projection")
        _refuse(config, family, "sliding_window", 0)
        dense.update(qk_norm=False, qk_norm_scope="head")
        own.update(norm_topk_prob=config.norm_topk_prob, clip_qkv=None)
    hf = hf_llama.config_to_hf(config.replace(**dense))
    if config.family == "olmoe":
        hf = {k: v for k, v in hf.items() if k not in ("mlp_bias", "head_dim")}
    return {**hf, "model_type": config.family, "architectures": [family.architecture], **own}


def _qwen2_moe_out(config: ModelConfig, family: Family) -> dict:
    """A Qwen2-MoE's own keys: it always has a gated shared expert, and no window here."""
    if not config.shared_expert_d_ff:
        raise ValueError("a Hugging Face Qwen2-MoE has a shared expert: ModelConfig.shared_expert_d_ff must "
                         "be > 0, this model has 0")
    _refuse(config, family, "shared_expert_gate", True)
    _refuse(config, family, "sliding_window", 0)
    return dict(moe_intermediate_size=config.expert_width, norm_topk_prob=config.norm_topk_prob,
                shared_expert_intermediate_size=config.shared_expert_d_ff, decoder_sparse_step=1,
                mlp_only_layers=[], use_sliding_window=False, sliding_window=None, qkv_bias=True)


def _shared_tensors() -> tuple:
    """Qwen2-MoE's shared expert and its gate (shared_expert_d_ff > 0)."""
    shared = lambda c: c.shared_expert_d_ff > 0  # noqa: E731
    stem = _LAYER + "mlp.shared_expert."
    gate_up = (lambda c: (c.shared_expert_d_ff, c.d_model))  # noqa: E731  nn.Linear's (out, in)
    return (*(Tensor(f"{stem}{name}_proj.weight", (f"blocks.ffn.shared.w_{name}",), gate_up, transpose=True,
                     when=shared) for name in ("gate", "up")),
            Tensor(stem + "down_proj.weight", ("blocks.ffn.shared.w_down",),
                   lambda c: (c.d_model, c.shared_expert_d_ff), transpose=True, when=shared),
            Tensor(_LAYER + "mlp.shared_expert_gate.weight", ("blocks.ffn.shared_gate",), lambda c: (1, c.d_model),
                   transpose=True, when=lambda c: shared(c) and c.shared_expert_gate))


def tensors_of(config: ModelConfig) -> tuple:
    """The table of everything but the experts: the dense family's attention, norms, embedding
    and head (hf_llama.TENSORS without its MLP), the QK-norm at its scope's width, the router."""
    family = FAMILIES[config.family]
    keep = [t for t in hf_llama.TENSORS if not t.ours[0].startswith("blocks.ffn.") and "_norm." not in t.hf]
    return (*keep,
            Tensor(_LAYER + "self_attn.q_norm.weight", ("blocks.attn.q_norm.scale",),
                   lambda c: _qk_width(c, c.n_heads), when=lambda c: c.qk_norm),
            Tensor(_LAYER + "self_attn.k_norm.weight", ("blocks.attn.k_norm.scale",),
                   lambda c: _qk_width(c, c.kv_heads), when=lambda c: c.qk_norm),
            Tensor(f"{_LAYER}{family.moe}.gate.weight", ("blocks.ffn.router",), lambda c: (c.n_experts, c.d_model),
                   transpose=True),
            *_shared_tensors())


def _take(raw: dict, name: str, shape: tuple, dtype, where: str) -> np.ndarray:
    if name not in raw:
        raise HFFormatError(f"{where}: tensor {name!r} is missing")
    a = np.asarray(float_weight(raw.pop(name), name, where), dtype)
    if a.shape != shape:
        raise HFFormatError(f"{where}: tensor {name!r} has shape {a.shape}, config.json needs {shape}")
    return a


def _experts_in(raw: dict, config: ModelConfig, dtype, where: str) -> dict:
    """w_gate, w_up (L, E, D, F), w_down (L, E, F, D) popped from ``raw``: per expert, or fused."""
    family, E, D, F = FAMILIES[config.family], config.n_experts, config.d_model, config.expert_width
    gate, up, down = [], [], []
    for l in range(config.n_layers):
        fused = f"model.layers.{l}.mlp.experts."
        if fused + "gate_up_proj" in raw:
            gu = _take(raw, fused + "gate_up_proj", (E, 2 * F, D), dtype, where)
            dn = _take(raw, fused + "down_proj", (E, D, F), dtype, where)
            g, u = gu[:, :F], gu[:, F:]
        else:
            stem = f"model.layers.{l}.{family.moe}.experts."
            g, u, dn = (np.stack([_take(raw, f"{stem}{e}.{name}.weight", shape, dtype, where) for e in range(E)])
                        for name, shape in zip(family.names, ((F, D), (F, D), (D, F))))
        gate.append(np.swapaxes(g, -1, -2))
        up.append(np.swapaxes(u, -1, -2))
        down.append(np.swapaxes(dn, -1, -2))
    return {"w_gate": np.stack(gate), "w_up": np.stack(up), "w_down": np.stack(down)}


def params_from_hf(tensors: dict, config: ModelConfig, dtype=np.float32, where: str = "tensors") -> dict:
    """The params pytree of the MoE ``config`` from a state dict {HF name: array}, the experts
    stored one by one or fused; ``where`` names the source in errors."""
    raw = {k: v for k, v in tensors.items() if not k.endswith(hf_llama.BUFFERS)}
    if config.tie_embeddings:
        raw.pop(hf_llama.HEAD, None)
    if config.family == "mixtral":  # the router as transformers 5 holds it in memory
        raw = {k.replace(".mlp.gate.", ".block_sparse_moe.gate."): v for k, v in raw.items()}
    experts = _experts_in(raw, config, dtype, where)
    params = params_in(tensors_of(config), raw, config, dtype, where)
    params["blocks"]["ffn"].update({k: np.ascontiguousarray(v) for k, v in experts.items()})
    return params


def _experts_out(params: dict, config: ModelConfig) -> dict:
    family, out = FAMILIES[config.family], {}
    ffn = params["blocks"]["ffn"]
    for key, name in zip(("w_gate", "w_up", "w_down"), family.names):
        w = np.asarray(ffn[key])  # (L, E, in, out)
        for l in range(config.n_layers):
            for e in range(config.n_experts):
                out[f"model.layers.{l}.{family.moe}.experts.{e}.{name}.weight"] = np.ascontiguousarray(
                    np.asarray(w[l, e].T, np.float32))
    return out


def read_hf_moe(folder, dtype=np.float32) -> tuple[dict, ModelConfig]:
    """(params in ``dtype``, ModelConfig) of the Hugging Face MoE model in ``folder``."""
    config = config_from_hf(read_config_json(folder))
    tensors = read_tensors(folder)
    config = hf_llama.config_of_tensors(config, tensors)
    return params_from_hf(tensors, config, dtype, str(folder)), config


def write_hf_moe(folder, params, config: ModelConfig) -> Path:
    """Write ``params`` as config.json + model.safetensors (float32, the names save_pretrained writes)."""
    from safetensors.numpy import save_file
    config = config if config.family else config.replace(family=family_of(config))
    hf = config_to_hf(config)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({**params_out(tensors_of(config), params, config), **_experts_out(params, config)},
              str(folder / SAFETENSORS), metadata={"format": "pt"})
    (folder / CONFIG_JSON).write_text(json.dumps(hf, indent=2) + "\n")
    return folder
