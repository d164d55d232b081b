"""Sampling from an imported model (a Hugging Face folder or a GGUF file), one token at a
time, so each can be shown as it comes: ``stream_tokens`` yields ids until a stop id or
``max_new_tokens``; ``render_chat`` (data/chat.py, shared with chat data) renders the model's chat
template (Jinja, as transformers renders it) for ``--chat``; ``load_model`` reads the weights, the tokenizer
and the chat settings without a training run.

The key/value cache holds the prompt and the new tokens only (generate.py's
``cache_config``: their count rounded up to a multiple of 64, at most max_seq_len). The
prompt is one prefill (padded to a multiple of 64, so a conversation's nearby turns share a
compile), each new token one cached step (generate.py's ``sample_logits`` draws it); the
three programs are compiled ahead of time, so ``timing`` reports compiling, the prefill and
the decode steps apart. Step i draws with the key ``fold_in(PRNGKey(seed), i)``.
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.data.chat import render_chat  # noqa: F401 (generate --chat renders with it)
from jaxformer.formats.hf import read_chat, read_hf, resolve_source
from jaxformer.inference.generate import check_options, compiled, sample_logits
from jaxformer.model.config import ModelConfig
from jaxformer.model.kv_cache import cache_config, forward_cached, round_up
from jaxformer.model.kv_cache import prefill as kv_prefill
from jaxformer.model.validate import validate_ids


def load_model(spec: str, dtype=np.float32, model: dict | None = None):
    """(params, config, ModelChat) of ``--init-from spec``: a folder, a .gguf file or a hub
    id; ``model``: ModelConfig fields to change that keep the shapes."""
    source = resolve_source(spec)
    params, config = read_hf(source, dtype)
    params = jax.tree_util.tree_map(jnp.asarray, params)
    return params, config.replace(**(model or {})), read_chat(source)


@functools.partial(jax.jit, static_argnames=("config",))
def _prefill(params, ids, n, config: ModelConfig):
    """ids (1, t): the prompt in [0, n), padding after (masked, later overwritten) ->
    (the logits after the prompt (V,), the cache)."""
    logits, cache = kv_prefill(params, ids, config)
    return jax.lax.dynamic_index_in_dim(logits[0], n - 1, keepdims=False), cache


@functools.partial(jax.jit, static_argnames=("top_k", "greedy", "top_p"))
def _draw(key, logits, temperature, *, top_k, greedy, top_p):
    return sample_logits(key, logits, temperature, top_k, greedy, top_p)


@functools.partial(jax.jit, static_argnames=("config",))
def _step(params, token, cache, n, config: ModelConfig):
    logits, cache = forward_cached(params, token.reshape(1, 1), cache, n, config)
    return logits[0, 0], cache


def stream_tokens(params, config: ModelConfig, prompt_ids, max_new_tokens: int, *,
                  temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                  seed: int = 0, stop_ids=(), timing: dict | None = None,
                  log: Callable[[str], None] | None = None) -> Iterator[int]:
    """New token ids after ``prompt_ids``, one at a time, ending after a stop id (not
    yielded) or ``max_new_tokens``. The prompt keeps its last max_seq_len - max_new_tokens
    tokens when prompt and output do not fit the model's max_seq_len.

    timing: a dict filled as generate.generate_many fills it (the decode's tokens are the
    cached steps run, a stop id's among them); complete once the stream ends. log: told
    what is compiled, before it is."""
    check_options(max_new_tokens, temperature, top_k, top_p)
    if not config.causal:
        raise ValueError("generation needs a causal model (config.causal=True)")
    prompt = np.asarray(prompt_ids).reshape(-1)
    if prompt.size == 0 or max_new_tokens == 0:
        return
    validate_ids(prompt, config.vocab_size, "prompt")
    prompt = prompt[-max(config.max_seq_len - max_new_tokens, 1):].astype(np.int32)
    P = len(prompt)
    config = cache_config(config, P + max_new_tokens)
    ids = np.zeros((1, min(round_up(P), config.max_seq_len)), np.int32)
    ids[0, :P] = prompt
    key, temp, stops = jax.random.PRNGKey(seed), jnp.float32(temperature), set(map(int, stop_ids))
    if log:
        log(f"compiling the sampler: a prefill of {ids.shape[1]} positions, a cache of "
            f"{config.max_seq_len} slots")
    prefill, draw, step, compile_s = _programs(params, config, ids, key, temp, top_k, top_p, temperature == 0)
    times = dict(compile_s=compile_s, prefill_tokens=P, prefill_s=0.0, decode_tokens=0, decode_s=0.0,
                 cache_len=config.max_seq_len)
    try:
        t0 = time.perf_counter()
        logits, cache = prefill(params, jnp.asarray(ids), jnp.int32(P))
        token = int(draw(jax.random.fold_in(key, 0), logits, temp))
        times["prefill_s"] = time.perf_counter() - t0
        n = P
        for i in range(max_new_tokens):
            if token in stops:
                return
            yield token
            if i + 1 == max_new_tokens or n >= config.max_seq_len:
                return
            t0 = time.perf_counter()
            logits, cache = step(params, jnp.int32(token), cache, jnp.int32(n))
            token = int(draw(jax.random.fold_in(key, i + 1), logits, temp))
            times["decode_s"] += time.perf_counter() - t0
            times["decode_tokens"] += 1
            n += 1
    finally:
        if timing is not None:
            run_s = times["prefill_s"] + times["decode_s"]
            timing.update(times, run_s=run_s, s_per_token=run_s / (1 + times["decode_tokens"]))


def _programs(params, config, ids, key, temp, top_k, top_p, greedy):
    """(prefill, draw, step, the seconds compiling them): compiled ahead of time."""
    prefill, a = compiled(_prefill, params, ids, jnp.int32(0), config=config)
    logits, cache = jax.eval_shape(functools.partial(_prefill, config=config), params, ids, jnp.int32(0))
    draw, b = compiled(_draw, key, logits, temp, top_k=int(top_k or 0), greedy=greedy,
                       top_p=float(1.0 if top_p is None else top_p))
    step, c = compiled(_step, params, jnp.int32(0), cache, jnp.int32(0), config=config)
    return prefill, draw, step, a + b + c


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
