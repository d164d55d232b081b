"""Sampling from an imported model (a Hugging Face folder or a GGUF file), one token at a
time, so each can be shown as it comes: ``stream_tokens`` yields ids until a stop id or
``max_new_tokens``; ``render_chat`` (data/chat.py, shared with chat data) renders the model's chat
template (Jinja, as transformers renders it) for ``--chat``; ``load_model`` reads the weights, the tokenizer
and the chat settings without a training run.

The key/value cache holds the prompt and the new tokens only: the config's max_seq_len is
cut to that length (rounded up to a multiple of 64, so nearby lengths share a compile)
when the positions are rotary or sinusoidal (no table to index: the cache's length does not
change what position j computes). The prompt is one prefill, each new token one jitted
cached step (generate.py's ``sample_logits`` draws it); sample step i draws with the key
``fold_in(PRNGKey(seed), i)``.
"""

from __future__ import annotations

import functools
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.checkpoints.hf import read_chat, read_hf, resolve_source
from jaxformer.data.chat import render_chat  # noqa: F401 (generate --chat renders with it)
from jaxformer.inference.generate import check_options, sample_logits
from jaxformer.model.config import ModelConfig
from jaxformer.model.kv_cache import forward_cached, init_cache
from jaxformer.model.validate import validate_ids

ROUND = 64  # cache lengths are multiples of this


def load_model(spec: str, dtype=np.float32, model: dict | None = None):
    """(params, config, ModelChat) of ``--init-from spec``: a folder, a .gguf file or a hub
    id; ``model``: ModelConfig fields to change that keep the shapes."""
    source = resolve_source(spec)
    params, config = read_hf(source, dtype)
    params = jax.tree_util.tree_map(jnp.asarray, params)
    return params, config.replace(**(model or {})), read_chat(source)


def cache_config(config: ModelConfig, length: int) -> ModelConfig:
    """``config`` with max_seq_len cut to ``length`` rounded up to ROUND (never past the
    model's own), when its positions need no table; learned positions keep theirs."""
    if config.positions == "learned":
        return config
    return config.replace(max_seq_len=min(config.max_seq_len, -(-length // ROUND) * ROUND))


@functools.partial(jax.jit, static_argnames=("config",))
def _prefill(params, ids, config: ModelConfig):
    cache = init_cache(config, 1, params["tok_embed"].dtype)
    logits, cache = forward_cached(params, ids, cache, 0, config)
    return logits[0, -1], cache


@functools.partial(jax.jit, static_argnames=("top_k", "greedy", "top_p"))
def _draw(key, logits, temperature, *, top_k, greedy, top_p):
    return sample_logits(key, logits, temperature, top_k, greedy, top_p)


@functools.partial(jax.jit, static_argnames=("config",))
def _step(params, token, cache, n, config: ModelConfig):
    logits, cache = forward_cached(params, token.reshape(1, 1), cache, n, config)
    return logits[0, 0], cache


def stream_tokens(params, config: ModelConfig, prompt_ids, max_new_tokens: int, *,
                  temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                  seed: int = 0, stop_ids=()) -> Iterator[int]:
    """New token ids after ``prompt_ids``, one at a time, ending after a stop id (not
    yielded) or ``max_new_tokens``. The prompt keeps its last max_seq_len - max_new_tokens
    tokens when prompt and output do not fit the model's max_seq_len."""
    check_options(max_new_tokens, temperature, top_k, top_p)
    if not config.causal:
        raise ValueError("generation needs a causal model (config.causal=True)")
    prompt = np.asarray(prompt_ids).reshape(-1)
    if prompt.size == 0 or max_new_tokens == 0:
        return
    validate_ids(prompt, config.vocab_size, "prompt")
    prompt = prompt[-max(config.max_seq_len - max_new_tokens, 1):].astype(np.int32)
    config = cache_config(config, len(prompt) + max_new_tokens)
    draw = functools.partial(_draw, top_k=int(top_k or 0), greedy=temperature == 0,
                             top_p=float(1.0 if top_p is None else top_p))
    key, temp, stops = jax.random.PRNGKey(seed), jnp.float32(temperature), set(map(int, stop_ids))
    logits, cache = _prefill(params, jnp.asarray(prompt[None]), config)
    n = len(prompt)
    for i in range(max_new_tokens):
        token = draw(jax.random.fold_in(key, i), logits, temp)
        if int(token) in stops:
            return
        yield int(token)
        if i + 1 == max_new_tokens or n >= config.max_seq_len:
            return
        logits, cache = _step(params, token, cache, jnp.int32(n), config)
        n += 1


def stream_text(tokenizer, ids: Iterator[int]) -> Iterator[str]:
    """The text of the ids as it grows: each piece once its bytes decode whole (a
    character split across tokens waits for its last byte)."""
    seen, shown = [], ""
    for i in ids:
        seen.append(i)
        text = tokenizer.decode(seen)
        if not text.endswith("\ufffd") and len(text) > len(shown):
            yield text[len(shown):]
            shown = text
