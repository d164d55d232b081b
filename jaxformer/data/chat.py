"""Chat data: conversations rendered with a model's chat template, and a loss mask that is
1 on the assistant's tokens only (``jaxformer prepare`` of a chat JSONL file).

A chat corpus is a ``*.jsonl`` file (or a folder of them), one conversation a line:

    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}
    {"prompt": "...", "completion": "..."}    (a user turn and the assistant's answer;
                                               each may also be a list of messages)

``render_chat`` renders a template (Jinja's sandbox, transformers' settings), as
``generate --chat`` does. ``encode_conversation`` cuts the rendered text at every
assistant turn: ``render(messages[:i], add_generation_prompt=True)`` is the text before
assistant message i (what the model is given when it answers), ``render(messages[:i + 1])``
the text through its end; the text between the two (the content, the end-of-turn token and
whatever the template writes after it in the same turn, e.g. ChatML's newline) is the
assistant's. Each prefix must be the start of the whole conversation's text, else the
template does not render prefixes consistently and the conversation is refused by line.
The pieces are tokenized apart (a token never spans a turn boundary), the assistant's
pieces masked 1, the rest 0.

The chat settings (``chat``) are any object with ``chat_template``, ``bos_token``,
``eos_token`` and ``tokenizer`` (formats.hf.ModelChat).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Iterator

import numpy as np

from jaxformer.data.sources import HF_PREFIX, corpus_files

ROLES = ("system", "user", "assistant", "tool")


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat(chat, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The chat template of ``chat`` rendered for ``messages`` [{"role", "content"}], in
    Jinja's sandbox with transformers' settings (trim_blocks, lstrip_blocks)."""
    if not chat.chat_template:
        raise ValueError("--chat: this model has no chat template (tokenizer.chat_template or "
                         "tokenizer_config.json chat_template); use --prompt")
    from jinja2.exceptions import TemplateError
    try:
        return _compiled(chat.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=chat.bos_token, eos_token=chat.eos_token)
    except TemplateError as e:
        raise ValueError(f"the chat template cannot be rendered: {e}") from None


def _messages(value, where: str, field: str) -> list[dict]:
    """A list of {"role", "content"} checked: known roles, text content."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {field!r} must be a non-empty list of {{\"role\", \"content\"}} objects")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{where}: {field}[{k}] must be an object with \"role\" and \"content\"")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: {field}[{k}] has role {m['role']!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ValueError(f"{where}: {field}[{k}] content is {type(m['content']).__name__}, not a string")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def conversation(record, where: str) -> list[dict]:
    """The messages of one JSONL record: its "messages", or its "prompt" and "completion"
    (strings: a user turn and an assistant turn; or lists of messages)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if "messages" in record:
        return _messages(record["messages"], where, "messages")
    if "prompt" in record and "completion" in record:
        turns = []
        for field, role in (("prompt", "user"), ("completion", "assistant")):
            value = record[field]
            if isinstance(value, str):
                turns.append({"role": role, "content": value})
            else:
                turns += _messages(value, where, field)
        return turns
    fields = ", ".join(sorted(map(str, record))[:8]) or "none"
    raise ValueError(f"{where}: a chat record needs \"messages\" (or \"prompt\" and \"completion\"); "
                     f"its fields: {fields}")


def _first_record(path: str):
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    return json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    return None
    return None


def is_chat_corpus(spec, text_field: str = "text") -> bool:
    """Whether ``spec`` is chat data: JSONL files whose first record holds "messages" (or
    "prompt" and "completion") and no ``text_field``."""
    if not isinstance(spec, str) or not spec or spec.startswith(HF_PREFIX):
        return False
    path = os.path.expanduser(spec)
    if not (os.path.isfile(path) or os.path.isdir(path)):
        return False
    files = corpus_files(spec)
    if not files or not all(f.endswith(".jsonl") for f in files):
        return False
    first = _first_record(files[0])
    return (isinstance(first, dict) and text_field not in first
            and ("messages" in first or ("prompt" in first and "completion" in first)))


def chat_records(spec: str) -> Iterator[tuple[str, list[dict]]]:
    """(where "file:line", messages) of every non-blank line of the chat JSONL files."""
    for path in corpus_files(spec):
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{n}"
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise ValueError(f"{where}: not a JSON record ({e})") from None
                yield where, conversation(record, where)


def assistant_spans(chat, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """(the conversation's text, [(start, end)] character spans of each assistant turn)."""
    text = render_chat(chat, messages, add_generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_chat(chat, messages[:i], add_generation_prompt=True)
        through = render_chat(chat, messages[:i + 1], add_generation_prompt=False)
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            raise ValueError(f"{where}: the chat template does not render this conversation's prefixes "
                             f"consistently (the text up to message {i}, an assistant turn, is not the "
                             "start of the whole conversation's), so its assistant tokens cannot be found")
        spans.append((len(before), len(through)))
    if not spans:
        raise ValueError(f"{where}: the conversation has no assistant message (nothing to learn)")
    return text, spans


def encode_conversation(chat, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
    """(int32 ids, uint8 mask) of a conversation: mask 1 on the assistant's tokens."""
    text, spans = assistant_spans(chat, messages, where)
    cuts, at = [], 0
    for start, end in spans:
        cuts += [(text[at:start], 0), (text[start:end], 1)]
        at = end
    cuts.append((text[at:], 0))
    ids, mask = [], []
    for piece, bit in cuts:
        if piece:
            try:
                part = chat.tokenizer.encode(piece)
            except ValueError as e:  # characters the vocabulary lacks (lines of the rendered text)
                raise ValueError(f"{where}: {e}") from None
            ids.append(part)
            mask.append(np.full(len(part), bit, np.uint8))
    return np.concatenate(ids).astype(np.int32), np.concatenate(mask)


def check_template(chat, tokenizer_spec) -> None:
    """One line when ``chat`` (the tokenizer's chat settings) has no template to render."""
    if chat is None or not getattr(chat, "chat_template", None):
        raise ValueError(f"chat data needs a tokenizer with a chat template; --tokenizer {tokenizer_spec} "
                         "has none (give a model folder with tokenizer_config.json's chat_template or "
                         "chat_template.jinja, or a .gguf file with tokenizer.chat_template)")


def chat_stream(chat, spec: str, counts: dict) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, mask) of every conversation of ``spec``, one conversation a pair, joined by the
    tokenizer's end-of-text id (mask 0), which opens each conversation but the first (so a
    document's first token is where a packed row's next segment starts); ``counts`` gets
    "documents", "bytes" and "assistant_tokens"."""
    eot = getattr(chat.tokenizer, "eot_id", None)
    for where, messages in chat_records(spec):
        ids, mask = encode_conversation(chat, messages, where)
        if counts["documents"] and eot is not None:
            ids, mask = np.concatenate([[eot], ids]).astype(np.int32), np.concatenate([[0], mask]).astype(np.uint8)
        counts["documents"] += 1
        counts["bytes"] += sum(len(m["content"].encode("utf-8")) for m in messages)
        counts["assistant_tokens"] += int(mask.sum())
        yield ids, mask
