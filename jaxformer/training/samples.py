"""Replies to held-out prompts at each evaluation: what a fine-tune is teaching, beside its loss.

With ``settings.eval_samples`` = N > 0 and a chat data folder, each evaluation takes the
first N conversations of the folder's validation split, cuts each before its first assistant
token (the prompt the model answers: the template's text up to the assistant's turn, as
``prepare`` rendered it), and samples greedily at most SAMPLE_TOKENS tokens, cut at the end
of turn (the template's eos token, or the end-of-text id): ``greedy``, one prefill of the
prompt's window (prompt + reply, rounded up as the generator's cache: kv_cache.cache_config) over
the model's key/value cache (model/kv_cache.py, as ``jaxformer generate`` samples), then one
cached step per token. A LoRA run's adapters are merged into its frozen base for it. The replies
go to the run's log lines and, as ``samples``, to the evaluation's metrics record.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import data
from jaxformer.data import packing
from jaxformer.model.kv_cache import cache_config, forward_cached, prefill
from jaxformer.model.lora import merge

SAMPLE_TOKENS = 32


@functools.lru_cache(maxsize=4)
def folder_meta(data_dir: str) -> dict:
    """A data folder's meta.json, read once (each evaluation asks for it); read-only."""
    return data.read_meta(data_dir)


@functools.lru_cache(maxsize=4)
def held_out_prompts(data_dir: str, n: int) -> tuple[np.ndarray, ...]:
    """The prompts (int32 ids) of the first ``n`` validation conversations of a chat data
    folder that hold an assistant token: each up to that token."""
    meta = folder_meta(data_dir)
    if not meta.get("doc_starts") or not meta.get("mask"):
        return ()
    val = data.open_split(data_dir, meta, "val")
    if not len(val):
        return ()
    ids, mask = np.asarray(val), np.asarray(val.mask)
    docs = np.asarray(val.docs)
    starts, lengths = packing.conversation_spans(docs, len(ids))
    out = []
    for s, length in zip(starts, lengths):
        if s == 0 and not docs[0]:
            continue  # the end of a conversation the split cut
        answer = np.flatnonzero(mask[s:s + length])
        if len(answer) and answer[0] > 0:
            out.append(ids[s:s + answer[0]].astype(np.int32))
        if len(out) == n:
            break
    return tuple(out)


def stop_ids(tokenizer, meta: dict) -> set[int]:
    """The end-of-turn ids: the model's own, as ``generate --chat`` stops at them (``prepare``
    records them in meta.json); for a folder prepared before that, the chat template's eos
    token and the end-of-text id."""
    chat = meta.get("chat") or {}
    if chat.get("stop_ids"):
        return {int(i) for i in chat["stop_ids"]}
    stops = set()
    eos = chat.get("eos_token")
    lookup = getattr(getattr(tokenizer, "tokenizer", None), "token_to_id", None)
    if eos and lookup is not None and lookup(eos) is not None:
        stops.add(int(lookup(eos)))
    if getattr(tokenizer, "eot_id", None) is not None:
        stops.add(int(tokenizer.eot_id))
    return stops


@functools.partial(jax.jit, static_argnames=("config", "n_new"))
def greedy(params, window, first, config, n_new: int):
    """window (1, W) int32 with a prompt in its first ``first`` positions (W a multiple of
    kv_cache.ROUND, first + n_new <= W) -> the ``n_new`` greedy tokens (n_new,) after it: one
    prefill of the window over the model's key/value cache (the slots past the prompt are
    masked, then overwritten), then one cached step per token."""
    logits, cache = prefill(params, window, config)  # (1, W, V)
    tok = jnp.argmax(jax.lax.dynamic_index_in_dim(logits[0], first - 1, keepdims=False)).astype(jnp.int32)

    def step(carry, i):  # token i of the reply goes in at slot first + i
        tok, cache = carry
        logits, cache = forward_cached(params, tok[None, None], cache, first + i, config)  # (1, 1, V)
        return (jnp.argmax(logits[0, 0]).astype(jnp.int32), cache), tok

    _, new = jax.lax.scan(step, (tok, cache), jnp.arange(n_new))
    return new


def replies(params, config, tokenizer, prompts, stops: set[int], max_new_tokens: int = SAMPLE_TOKENS):
    """[(prompt text, reply text)]: greedy continuations cut before the first stop id."""
    out = []
    for prompt in prompts:
        room = max(0, min(max_new_tokens, config.max_seq_len - len(prompt)))
        windowed = cache_config(config, len(prompt) + room)
        window = np.zeros((1, windowed.max_seq_len), np.int32)
        window[0, :len(prompt)] = prompt
        new = np.asarray(greedy(params, jnp.asarray(window), jnp.int32(len(prompt)), windowed,
                                room)).tolist() if room else []
        ended = next((i for i, t in enumerate(new) if t in stops), len(new))
        out.append((tokenizer.decode(prompt.tolist()), tokenizer.decode(new[:ended])))
    return out


def _short(text: str, keep: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= keep else "..." + text[-keep:]


def at_eval(run, params, step: int, val_loss: float, log) -> dict:
    """The eval hook of the training loop: {"samples": [{"prompt", "reply"}]} for the record of
    ``step`` (and a line per reply to ``log``); {} when the run samples none."""
    settings = run.settings
    if not settings.eval_samples or not settings.data:
        return {}
    prompts = held_out_prompts(str(settings.data), settings.eval_samples)
    if not prompts:
        return {}
    if run.spec.frozen is not None:
        params = merge(run.spec.frozen.params, params, run.spec.lora)
    stops = stop_ids(run.data.tokenizer, folder_meta(str(settings.data)))
    pairs = replies(params, run.config, run.data.tokenizer, prompts, stops)
    if log:
        log(f"step {step}: val loss {val_loss:.4f}; greedy replies to {len(pairs)} held-out prompts:")
        for prompt, reply in pairs:
            log(f"  {_short(prompt)!r} -> {reply!r}")
    return {"samples": [{"prompt": p, "reply": r} for p, r in pairs]}
