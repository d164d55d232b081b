"""Where a run's model came from, for what its exports carry: the chat settings it was trained
with, and a name of its frozen base that Hugging Face (PEFT) resolves.

    run_chat(settings, tokenizer) -> (ModelChat | None, where)   the template, bos/eos, stop ids
    base_name(source) -> (name | None, why)                       a folder or hub id, for PEFT

The chat settings come from the first of: a LoRA run's frozen base (``lora_base``), the model
whose tokenizer the run reads (``--tokenizer`` / ``--init-from``'s own: a .gguf file, a
folder's tokenizer.json), the chat data it was prepared from (meta.json's ``chat``). Their
stop ids are looked up in the run's own tokenizer.

A GGUF file records the hub repository it was converted from in ``general.source.url``,
``general.source.repo_url`` (llama.cpp's convert_hf_to_gguf.py) or, in older files,
``general.source.huggingface.repository``. ``general.base_model.*`` is not read: it names the
model the source was itself fine-tuned from, other weights.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from jaxformer.data import read_meta
from jaxformer.formats.gguf_file import read_gguf_metadata
from jaxformer.formats.gguf_tokenizer import END_OF_TURN
from jaxformer.formats.hf import ModelChat, is_gguf, read_chat, resolve_source

HUB_KEYS = ("general.source.repo_url", "general.source.url", "general.source.huggingface.repository")
HUB_URL = re.compile(r"^(?:https?://)?(?:www\.)?(?:huggingface\.co|hf\.co)/([\w.-]+/[\w.-]+?)(?:\.git)?/?$")
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def _model_of_tokenizer(spec) -> str | None:
    """The model a ``--tokenizer`` value names: a .gguf file, the folder of a tokenizer.json."""
    if not isinstance(spec, str) or not os.path.exists(spec):
        return None
    if is_gguf(spec):
        return spec
    return str(Path(spec).parent) if Path(spec).name == "tokenizer.json" else None


def _chat_of(source: str):
    """(template, bos, eos) of a model source, or the reason it cannot be read."""
    try:
        chat = read_chat(source if is_gguf(source) else resolve_source(source))  # a .gguf is never downloaded
    except (ValueError, OSError) as e:
        return None, " ".join(str(e).split())
    return (chat.chat_template, chat.bos_token, chat.eos_token), ""


def run_chat(settings, tokenizer) -> tuple[ModelChat | None, str]:
    """(the chat settings of a run of ``settings`` over its ``tokenizer`` (an HFTokenizer), where
    they came from); (None, why) when no source gives a template."""
    sources = [(f"the frozen base {settings.lora_base}", settings.lora_base),
               (f"the tokenizer's model {settings.tokenizer}", _model_of_tokenizer(settings.tokenizer))]
    found, misses = None, []
    for where, source in sources:
        if not source:
            continue
        chat, why = _chat_of(source)
        if chat is None:
            misses.append(f"{where}: {why}")
        elif chat[0]:
            found = chat, where
            break
        else:
            misses.append(f"{where} has no chat template")
    if found is None and settings.data:
        try:
            meta = read_meta(settings.data).get("chat") or {}
        except ValueError as e:
            meta, misses = {}, misses + [str(e)]
        if meta.get("chat_template"):
            found = (meta["chat_template"], meta.get("bos_token", ""), meta.get("eos_token", "")), \
                f"the chat data {settings.data}"
    if found is None:
        return None, "; ".join(misses) or "the run names no model or chat data with a chat template"
    (template, bos, eos), where = found
    stops = {tokenizer.tokenizer.token_to_id(t) for t in (eos, *END_OF_TURN) if t}
    return ModelChat(tokenizer, template, bos, eos, tuple(sorted(i for i in stops if i is not None))), where


def hub_id(meta: dict) -> str | None:
    """The Hugging Face hub id ("owner/name") a GGUF file's metadata records as its source."""
    for key in HUB_KEYS:
        value = str(meta.get(key) or "").strip()
        match = HUB_URL.match(value)
        if match:
            return match.group(1)
        if key.endswith("huggingface.repository") and HUB_ID.match(value):
            return value
    return None


def base_name(source) -> tuple[str | None, str]:
    """(what a PEFT adapter over the model ``source`` names as its base, why): a folder (its
    absolute path), a hub id, a GGUF file's source repository; (None, why) when there is none."""
    if not source:
        return None, "the frozen base is the seed's init, which no folder holds"
    if is_gguf(source):
        found = hub_id(read_gguf_metadata(source)) if os.path.isfile(source) else None
        return (found, f"the hub repository {source} was converted from") if found else \
            (None, f"{source} is a GGUF file (PEFT loads folders and hub ids) that records no hub repository")
    if os.path.isdir(source):
        return os.path.abspath(source), "the folder the run started from"
    return str(source), "the hub id the run started from"
