"""Hugging Face model folders in and out, whichever architecture: the one place that picks
GPT-2 (hf_gpt2.py), a Llama-shaped family (hf_llama.py: llama, mistral, qwen2, qwen3, smollm3) or OLMo 2
and Gemma (hf_olmo_gemma.py: olmo2, gemma, gemma2, gemma3_text) or a mixture of experts (hf_moe.py:
mixtral, qwen3_moe, olmoe, qwen2_moe), by
config.json's ``model_type`` on the way in and on the way out by the family the ModelConfig
was imported as (``family``), else by its options; a ``.gguf`` file goes to gguf_file.py.
`train --init-from`, `compare-grads --init-from`, `generate --init-from` and `export --hf` go
through here.

    read_hf(folder or FILE.gguf, dtype) -> (params, ModelConfig)
    read_chat(folder or FILE.gguf) -> ModelChat: its tokenizer, chat template, stop ids
    write_hf(folder, params, config) -> (folder, model_type)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jaxformer.data.hf_tokenizers import HFTokenizer
from jaxformer.formats import hf_gpt2, hf_llama, hf_moe, hf_olmo_gemma
from jaxformer.formats.gguf_file import read_gguf, read_gguf_metadata
from jaxformer.formats.gguf_tokenizer import END_OF_TURN, gguf_chat, gguf_tokenizer
from jaxformer.formats.hf_files import HFFormatError, read_config_json, read_tensors, resolve_source  # noqa: F401
from jaxformer.model.config import ModelConfig

# config.json's model_type -> its mapping
FORMATS = {"gpt2": hf_gpt2, **{kind: hf_llama for kind in hf_llama.FAMILIES},
           **{kind: hf_olmo_gemma for kind in hf_olmo_gemma.FAMILIES}, **{kind: hf_moe for kind in hf_moe.FAMILIES}}


def read_hf(folder, dtype=np.float32) -> tuple[dict, ModelConfig]:
    """(params in ``dtype``, ModelConfig) of the Hugging Face model in ``folder`` (or of the
    GGUF file ``folder``); another model_type is one line naming it and the supported ones."""
    if is_gguf(folder):
        return read_gguf(folder, dtype)
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
    if mapping is not hf_gpt2:  # a tied config.json with its own stored head: untied, as transformers does
        config = hf_llama.config_of_tensors(config, tensors)
    return mapping.params_from_hf(tensors, config, dtype, str(folder)), config


def is_gguf(source) -> bool:
    """Whether ``source`` (a path) names a GGUF file rather than a model folder."""
    return Path(source).suffix.lower() == ".gguf" and not Path(source).is_dir()


def gguf_has_tokenizer(source) -> bool:
    """Whether ``source`` is a GGUF file whose metadata holds a tokenizer."""
    return is_gguf(source) and "tokenizer.ggml.model" in read_gguf_metadata(source)


class ModelChat(NamedTuple):
    """What sampling from an imported model needs besides its weights."""
    tokenizer: HFTokenizer
    chat_template: str | None  # Jinja text, None when the model has none
    bos_token: str
    eos_token: str
    stop_ids: tuple  # generation ends at any of these ids


def _token_text(value) -> str:
    return value.get("content", "") if isinstance(value, dict) else (value or "")


def read_chat(source) -> ModelChat:
    """The tokenizer and chat settings of a model folder (tokenizer.json; tokenizer_config.json's
    chat_template, bos_token, eos_token, or chat_template.jinja) or of a GGUF file (its
    metadata). One line naming the file when there is no tokenizer."""
    if is_gguf(source):
        meta = read_gguf_metadata(source)
        tokenizer = gguf_tokenizer(meta, source)
        chat = gguf_chat(meta, tokenizer)
        return ModelChat(tokenizer, chat["chat_template"], chat["bos_token"], chat["eos_token"],
                         tuple(chat["stop_ids"]))
    folder = Path(source)
    if not (folder / "tokenizer.json").is_file():
        raise HFFormatError(f"{folder} has no tokenizer.json: the model's own tokenizer is needed to sample from it")
    tokenizer = HFTokenizer.from_file(folder / "tokenizer.json")
    settings = {}
    if (folder / "tokenizer_config.json").is_file():
        settings = json.loads((folder / "tokenizer_config.json").read_text())
    template = settings.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    eos = _token_text(settings.get("eos_token"))
    stops = {tokenizer.tokenizer.token_to_id(t) for t in (eos, *END_OF_TURN) if t}
    return ModelChat(tokenizer, template if isinstance(template, str) else None,
                     _token_text(settings.get("bos_token")), eos, tuple(sorted(i for i in stops if i is not None)))


def hf_format(config: ModelConfig) -> str:
    """The Hugging Face model_type ``config`` exports to: the family it was imported as
    (config.family), else an MoE model's by its router and QK-norm (hf_moe.family_of), else "llama" when it has any of the modern block's options (RMS norm,
    rotary positions, the gated MLP, grouped-query attention, QK-norm, a head_dim, biases
    apart), else
    "gpt2". The format's config_to_hf refuses what it cannot hold."""
    if config.family:
        return config.family
    if config.n_experts:
        return hf_moe.family_of(config)
    modern = (config.norm_type == "rms" or config.positions == "rope" or config.mlp == "gated"
              or config.kv_heads != config.n_heads or config.qk_norm or config.head_dim
              or any(b is not None for b in (config.qkv_bias, config.out_bias, config.mlp_bias)))
    return "llama" if modern else "gpt2"


def write_hf(folder, params, config: ModelConfig):
    """Write ``params`` as the Hugging Face folder of ``hf_format(config)``: (folder,
    model_type). ValueError (one line, naming the option) when the format cannot hold it."""
    kind = hf_format(config)
    if config.n_experts and kind not in hf_moe.FAMILIES:
        raise ValueError(f"ModelConfig.n_experts {config.n_experts}: a mixture of experts exports as "
                         f"family {', '.join(map(repr, hf_moe.FAMILIES))}, not {kind!r}")
    if kind in hf_moe.FAMILIES and not config.n_experts:
        raise ValueError(f"a Hugging Face {kind} needs ModelConfig.n_experts > 0, this model has 0")
    write = {"gpt2": hf_gpt2.write_hf_gpt2, **{k: hf_olmo_gemma.write_hf_olmo_gemma for k in hf_olmo_gemma.FAMILIES},
             **{k: hf_moe.write_hf_moe for k in hf_moe.FAMILIES}}.get(kind, hf_llama.write_hf_llama)
    return write(folder, params, config), kind
