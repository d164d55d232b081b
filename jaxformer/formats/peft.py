"""LoRA adapters in PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

PEFT names each adapter after the module it wraps in the Hugging Face model, under
``base_model.model.``, with nn.Linear's (out, in) layout:

    base_model.model.model.layers.{l}.self_attn.q_proj.lora_A.weight   (r, in)  = A[l]^T
    base_model.model.model.layers.{l}.self_attn.q_proj.lora_B.weight   (out, r) = B[l]^T

The module names are the Llama-shaped families' (hf_llama.LINEARS: q_proj, k_proj, v_proj,
o_proj, gate_proj, up_proj, down_proj); ``peft.PeftModel.from_pretrained`` loads the folder
onto transformers' model of the same base (tests/test_lora_peft.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxformer.formats.hf_files import HFFormatError
from jaxformer.formats.hf_llama import LINEARS
from jaxformer.model.lora import TARGETS, LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers.{l}."
# our (group, weight) -> the HF module (self_attn.q_proj, ...)
MODULES = {(group, "w" + suffix): name for name, group, suffix, _, _ in LINEARS}
# PEFT's module name (q_proj, ...) -> our target name (q, ...)
TARGET_OF = {MODULES[site].split(".")[-1]: t for t, site in TARGETS.items() if site in MODULES}


def _module(group: str, weight: str) -> str:
    if (group, weight) not in MODULES:
        raise ValueError(f"LoRA target {weight} has no PEFT module name (PEFT adapters are written for "
                         f"Llama-shaped models: {', '.join(TARGET_OF.values())})")
    return MODULES[(group, weight)]


def save_peft(folder, adapters, lora: LoraConfig, base_model: str = "") -> Path:
    """Write ``adapters`` (model/lora.py's tree) as a PEFT LoRA folder; the tensors in the
    adapters' dtype. ``base_model``: what adapter_config.json names as the base."""
    from safetensors.numpy import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors, modules = {}, []
    for group, sites in adapters["blocks"].items():
        for weight, ab in sites.items():
            module = _module(group, weight)
            modules.append(module.split(".")[-1])
            a, b = np.asarray(ab["a"]), np.asarray(ab["b"])  # (L, I, r), (L, r, O)
            for l in range(a.shape[0]):
                key = PREFIX.format(l=l) + module
                tensors[key + ".lora_A.weight"] = np.ascontiguousarray(a[l].T)  # (r, I)
                tensors[key + ".lora_B.weight"] = np.ascontiguousarray(b[l].T)  # (O, r)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "lora_dropout": lora.dropout, "target_modules": sorted(modules), "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
              "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
              "rank_pattern": {}, "alpha_pattern": {}, "base_model_name_or_path": base_model or None}
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def read_peft(folder, n_layers: int, dtype=np.float32) -> tuple[dict, LoraConfig]:
    """(adapters, LoraConfig) of a PEFT LoRA folder for a model of ``n_layers`` layers;
    HFFormatError for what this reader does not take (another peft_type, rank or alpha
    patterns, biases, a module without a jaxformer target), a tensor missing, or one whose
    rank is not adapter_config.json's r."""
    from safetensors.numpy import load_file
    folder = Path(folder)
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    where = str(folder / ADAPTER_CONFIG)
    if config.get("peft_type") != "LORA":
        raise HFFormatError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise HFFormatError(f"{where}: {key} (a rank or alpha per module) is not read")
    if config.get("use_rslora") or config.get("use_dora") or config.get("bias", "none") != "none":
        raise HFFormatError(f"{where}: rsLoRA, DoRA and trained biases are not read")
    modules = config["target_modules"]
    modules = [modules] if isinstance(modules, str) else list(modules)
    unknown = [m for m in modules if m not in TARGET_OF]
    if unknown:
        raise HFFormatError(f"{where}: target module(s) {', '.join(unknown)} have no jaxformer projection")
    lora = LoraConfig(int(config["r"]), float(config["lora_alpha"]), float(config.get("lora_dropout", 0.0)),
                      tuple(TARGET_OF[m] for m in modules))
    tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    out = {}
    for t in lora.targets:
        group, weight = TARGETS[t]
        module = _module(group, weight)

        def get(l, which):
            key = PREFIX.format(l=l) + f"{module}.lora_{which}.weight"
            if key not in tensors:
                raise HFFormatError(f"{folder / ADAPTER_WEIGHTS}: tensor {key!r} is missing")
            shape = np.shape(tensors[key])  # A (r, in), B (out, r)
            rank = shape[0 if which == "A" else -1] if len(shape) == 2 else None
            if rank != lora.rank:
                raise HFFormatError(f"{folder / ADAPTER_WEIGHTS}: tensor {key!r} has shape {shape}, rank "
                                    f"{rank if rank is not None else '(not 2-D)'}, but {ADAPTER_CONFIG} says r = {lora.rank}")
            return np.asarray(tensors[key], dtype).T

        out.setdefault(group, {})[weight] = {"a": np.stack([get(l, "A") for l in range(n_layers)]),
                                             "b": np.stack([get(l, "B") for l in range(n_layers)])}
    return {"blocks": out}, lora
