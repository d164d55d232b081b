"""The files that let a Hugging Face folder chat, beside its weights or a PEFT adapter: the
tokenizer (``tokenizer.json``), its settings with the chat template and the special tokens
(``tokenizer_config.json``), and the ids generation starts, pads and stops with
(``generation_config.json``: ``eos_token_id`` lists the eos id and every end-of-turn id the
vocabulary holds, as formats/hf.py's read_chat stops at them).

    write_chat_files(folder, tokenizer, chat) -> [file names written]

``transformers.AutoTokenizer.from_pretrained(folder)`` reads the tokenizer and renders the
template (``apply_chat_template``); ``generate`` stops at the end of a turn; ``read_chat``
(`generate --init-from FOLDER --chat`) reads them back. A model folder's config.json gets
the same bos, eos and pad ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxformer.formats.hf_files import CONFIG_JSON

TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, GENERATION_CONFIG)


def special_ids(tokenizer, chat) -> dict:
    """{"bos_token_id", "eos_token_id" (the eos id first, then the other stop ids), "pad_token_id"
    (the eos id: these models pad with it)} of ``chat``'s tokens in ``tokenizer``; a token the
    vocabulary lacks is left out."""
    def id_of(text):
        return tokenizer.tokenizer.token_to_id(text) if text else None

    eos = id_of(chat.eos_token)
    stops = ([eos] if eos is not None else []) + sorted(i for i in chat.stop_ids if i != eos)
    ids = {"bos_token_id": id_of(chat.bos_token), "eos_token_id": stops or None,
           "pad_token_id": eos if eos is not None else (stops[0] if stops else None)}
    return {k: v for k, v in ids.items() if v is not None}


def write_chat_files(folder, tokenizer, chat=None) -> list[str]:
    """Write ``tokenizer`` (the project's HFTokenizer) and ``chat`` (a ModelChat: the template,
    bos and eos tokens, the stop ids; None: tokenizer.json alone) into ``folder``; a
    config.json there gets the same ids. The names of the files written."""
    folder = Path(folder)
    (folder / TOKENIZER_JSON).write_text(tokenizer.to_dict()["json"], encoding="utf-8")
    if chat is None:  # no special tokens to name: an earlier export's settings are not this model's
        for name in (TOKENIZER_CONFIG, GENERATION_CONFIG):
            (folder / name).unlink(missing_ok=True)
        return [TOKENIZER_JSON]
    ids = special_ids(tokenizer, chat)
    pad = ids.get("pad_token_id")
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                "bos_token": chat.bos_token or None, "eos_token": chat.eos_token or None,
                "pad_token": tokenizer.tokenizer.id_to_token(pad) if pad is not None else None}
    if chat.chat_template:
        settings["chat_template"] = chat.chat_template
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n",
                                           encoding="utf-8")
    (folder / GENERATION_CONFIG).write_text(json.dumps(ids, indent=2) + "\n")
    config = folder / CONFIG_JSON
    if config.is_file():
        config.write_text(json.dumps({**json.loads(config.read_text()), **ids}, indent=2) + "\n")
    return list(FILES)
