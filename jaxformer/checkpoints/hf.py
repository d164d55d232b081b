"""Hugging Face model folders in and out, whichever architecture: the one place that picks
GPT-2 (hf_gpt2.py) or Llama (hf_llama.py), by config.json's ``model_type`` on the way in
and by the ModelConfig on the way out. `train --init-from`, `compare-grads --init-from`
and `export --hf` go through here.

    read_hf(folder, dtype) -> (params, ModelConfig)
    write_hf(folder, params, config) -> (folder, model_type)
"""

from __future__ import annotations

import numpy as np

from jaxformer.checkpoints import hf_gpt2, hf_llama
from jaxformer.checkpoints.hf_files import HFFormatError, read_config_json, read_tensors, resolve_source  # noqa: F401
from jaxformer.model.config import ModelConfig

FORMATS = {"gpt2": hf_gpt2, "llama": hf_llama}  # config.json's model_type -> its mapping


def read_hf(folder, dtype=np.float32) -> tuple[dict, ModelConfig]:
    """(params in ``dtype``, ModelConfig) of the Hugging Face model in ``folder``; another
    model_type is one line naming it and the supported ones."""
    hf = read_config_json(folder)
    kind = hf.get("model_type")
    if kind not in FORMATS:
        raise HFFormatError(f"{folder}: config.json model_type {kind!r} is not supported "
                            f"(supported: {', '.join(FORMATS)})")
    mapping = FORMATS[kind]
    try:
        config = mapping.config_from_hf(hf)
    except HFFormatError as e:  # "config.json: ...": which folder's
        raise HFFormatError(f"{folder}: {e}") from None
    return mapping.params_from_hf(read_tensors(folder), config, dtype, str(folder)), config


def hf_format(config: ModelConfig) -> str:
    """The Hugging Face model_type ``config`` exports to: "llama" when it has any of the
    modern block's options (RMS norm, rotary positions, the gated MLP, grouped-query
    attention, QK-norm), else "gpt2". The format's config_to_hf refuses what it cannot hold."""
    modern = (config.norm_type == "rms" or config.positions == "rope" or config.mlp == "gated"
              or config.kv_heads != config.n_heads or config.qk_norm)
    return "llama" if modern else "gpt2"


def write_hf(folder, params, config: ModelConfig):
    """Write ``params`` as the Hugging Face folder of ``hf_format(config)``: (folder,
    model_type). ValueError (one line, naming the option) when the format cannot hold it."""
    kind = hf_format(config)
    write = hf_llama.write_hf_llama if kind == "llama" else hf_gpt2.write_hf_gpt2
    return write(folder, params, config), kind
