"""Hugging Face model folders in and out, whichever architecture: the one place that picks
GPT-2 (hf_gpt2.py) or a Llama-shaped family (hf_llama.py: llama, mistral, qwen2, qwen3), by
config.json's ``model_type`` on the way in and on the way out by the family the ModelConfig
was imported as (``family``), else by its options. `train --init-from`, `compare-grads --init-from`
and `export --hf` go through here.

    read_hf(folder, dtype) -> (params, ModelConfig)
    write_hf(folder, params, config) -> (folder, model_type)
"""

from __future__ import annotations

import numpy as np

from jaxformer.checkpoints import hf_gpt2, hf_llama
from jaxformer.checkpoints.hf_files import HFFormatError, read_config_json, read_tensors, resolve_source  # noqa: F401
from jaxformer.model.config import ModelConfig

# config.json's model_type -> its mapping
FORMATS = {"gpt2": hf_gpt2, **{kind: hf_llama for kind in hf_llama.FAMILIES}}


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
    tensors = read_tensors(folder)
    if mapping is hf_llama:  # a tied config.json with its own stored head: untied, as transformers does
        config = hf_llama.config_of_tensors(config, tensors)
    return mapping.params_from_hf(tensors, config, dtype, str(folder)), config


def hf_format(config: ModelConfig) -> str:
    """The Hugging Face model_type ``config`` exports to: the family it was imported as
    (config.family), else "llama" when it has any of the modern block's options (RMS norm,
    rotary positions, the gated MLP, grouped-query attention, QK-norm, a head_dim, biases
    apart), else
    "gpt2". The format's config_to_hf refuses what it cannot hold."""
    if config.family:
        return config.family
    modern = (config.norm_type == "rms" or config.positions == "rope" or config.mlp == "gated"
              or config.kv_heads != config.n_heads or config.qk_norm or config.head_dim
              or any(b is not None for b in (config.qkv_bias, config.out_bias, config.mlp_bias)))
    return "llama" if modern else "gpt2"


def write_hf(folder, params, config: ModelConfig):
    """Write ``params`` as the Hugging Face folder of ``hf_format(config)``: (folder,
    model_type). ValueError (one line, naming the option) when the format cannot hold it."""
    kind = hf_format(config)
    write = hf_gpt2.write_hf_gpt2 if kind == "gpt2" else hf_llama.write_hf_llama
    return write(folder, params, config), kind
