"""Sampling tokens from a trained model's params (text from a run folder: text.py).

With the key/value cache (the default), the cache holds the prompt and the new tokens:
S = P + N slots rounded up to a multiple of kv_cache.ROUND, at most the model's max_seq_len (a
shorter cache changes nothing position j computes). A prompt is run once (a prefill of
its last max_seq_len tokens, padded to a multiple of ROUND, so nearby lengths share a compile) and
then each new token is one step of the model on that token alone, inside one jitted
``lax.fori_loop`` whose carry holds the cache (jaxformer/model/kv_cache.py). Both programs
are compiled ahead of time, so ``timing`` reports compiling, the prefill and the decode
steps apart.

The sliding rule past S = max_seq_len (the cache then has S slots): it holds at most S
tokens, in slots 0..S-1, and
the token in slot j has position j (learned positions stay the ones the model
was trained on). When the cache is full and a new token arrives, the context
restarts as the last S // 2 tokens (the new one included), prefilled again at
positions 0..S//2 - 1; decoding then goes on one token per step. So up to S
tokens of prompt plus output, the cached sampler sees exactly what the model
sees in training; past S it sees between S // 2 and S tokens of context.

``use_cache=False`` is the reference: every step runs the whole model on the
window of the last S tokens (the window slides by one token per step past S).
Both give the same tokens while prompt + output fit in S.

Temperature 0 is greedy decoding; ``top_k`` keeps the k most likely tokens and
``top_p`` the smallest set of most likely tokens whose probability reaches p
(nucleus sampling) before drawing. Sample b of ``num_samples`` draws step i
with the key ``fold_in(fold_in(PRNGKey(seed), b), i)``.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.model.checks import check_int, check_number
from jaxformer.model.config import ModelConfig
from jaxformer.model.kv_cache import cache_config, forward_cached, round_up
from jaxformer.model.kv_cache import prefill as kv_prefill
from jaxformer.model.transformer import forward
from jaxformer.model.validate import validate_ids

def check_options(max_new_tokens, temperature, top_k, top_p=None, num_samples=1):
    """ValueError naming the sampling option that is out of range (top_k 0 and top_p 1: no limit)."""
    check_int("max_new_tokens", max_new_tokens, minimum=0)
    check_number("temperature", temperature, low=0)
    if top_k is not None:
        check_int("top_k", top_k, minimum=0, note="0: no limit")
    if top_p is not None:
        check_number("top_p", top_p, low=0, high=1, low_open=True, note="1: no limit")
    check_int("num_samples", num_samples)


def sample_logits(key, logits, temperature, top_k: int, greedy: bool, top_p: float = 1.0):
    """One token id from logits (V,): argmax when greedy, else a draw from
    softmax(logits / temperature) restricted to the top_k largest (0: all) and then
    to the nucleus: the fewest likeliest tokens whose probability sums to >= top_p
    (1: all; top_p is static, 1 skips the filter so it equals no top-p exactly)."""
    if greedy:
        return jnp.argmax(logits).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][-1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1:
        ranked = jnp.sort(logits)[::-1]  # (V,) largest first
        probs = jax.nn.softmax(ranked)
        before = jnp.cumsum(probs) - probs  # mass of the likelier tokens
        n_keep = jnp.sum(before < top_p)  # >= 1: the likeliest token always stays
        logits = jnp.where(logits < ranked[n_keep - 1], -jnp.inf, logits)
    return jax.random.categorical(key, logits).astype(jnp.int32)


def _sample_rows(keys, logits, temperature, top_k, greedy, top_p):
    """keys (B, 2), logits (B, V) -> one token per row (B,)."""
    return jax.vmap(lambda k, l: sample_logits(k, l, temperature, top_k, greedy, top_p))(keys, logits)


_DRAW = ("top_k", "greedy", "top_p")
_STATIC = ("config", "max_new_tokens", *_DRAW)


def _draw_rows(keys, i, logits, temperature, top_k, greedy, top_p):
    """Step i's tokens (B,) from logits (B, V): row b draws with fold_in(keys[b], i)."""
    step_keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)
    return _sample_rows(step_keys, logits, temperature, top_k, greedy, top_p)


@functools.partial(jax.jit, static_argnames=("config", "prefill"))
def _prefill_many(params, window, n_context, *, config: ModelConfig, prefill: int):
    """window int32 (B, S): the context in slots [0, n_context), zeros after. The model over
    slots [0, prefill) (prefill >= n_context; the padding is masked and later overwritten) ->
    (the logits after the context (B, V), the cache). No sampling option is compiled in, so
    every draw of one prompt shares it."""
    logits, cache = kv_prefill(params, window[:, :prefill], config)  # (B, prefill, V)
    return jax.lax.dynamic_index_in_dim(logits, n_context - 1, axis=1, keepdims=False), cache


@functools.partial(jax.jit, static_argnames=_STATIC)
def _decode_many(params, last, window, cache, n_context, keys, temperature, *, config: ModelConfig,
                 max_new_tokens: int, top_k: int, greedy: bool, top_p: float):
    """After _prefill_many (``last``: its logits (B, V)): the new tokens int32 (B, N), drawn one
    per step, the N - 1 after the first each one cached step; the sliding rule (module doc)
    when the cache is full."""
    S = config.max_seq_len
    keep = max(S // 2, 1)  # the context kept when the cache is full

    def feed(tok, window, cache, n):  # room in the cache: slot n gets the token
        window = jax.lax.dynamic_update_slice(window, tok[:, None], (jnp.int32(0), n))
        logits, cache = forward_cached(params, tok[:, None], cache, n, config)  # (B, 1, V)
        return logits[:, 0], window, cache, n + 1

    def refill(tok, window, cache, n):  # full: the last `keep` tokens, prefilled at slot 0
        kept = jnp.concatenate([window[:, S - keep + 1:], tok[:, None]], axis=1)  # (B, keep)
        window = jnp.pad(kept, ((0, 0), (0, S - keep)))
        logits, cache = forward_cached(params, window, cache, 0, config)
        return logits[:, keep - 1], window, cache, jnp.int32(keep)

    def body(i, carry):
        out, window, cache, n = carry
        tok = out[:, i - 1]  # the token sampled last step goes into the cache
        last, window, cache, n = jax.lax.cond(n < S, feed, refill, tok, window, cache, n)
        return out.at[:, i].set(_draw_rows(keys, i, last, temperature, top_k, greedy, top_p)), window, cache, n

    first = _draw_rows(keys, 0, last, temperature, top_k, greedy, top_p)  # (B,)
    out = jnp.zeros((first.shape[0], max_new_tokens), jnp.int32).at[:, 0].set(first)
    carry = (out, window, cache, jnp.asarray(n_context, jnp.int32))
    return jax.lax.fori_loop(1, max_new_tokens, body, carry)[0]


@functools.partial(jax.jit, static_argnames=_STATIC)
def _sample_loop(params, buffer, n_prompt, key, temperature, *, config: ModelConfig,
                 max_new_tokens: int, top_k: int, greedy: bool, top_p: float):
    """The reference, no cache: buffer int32 (S + N,) holds the prompt in [0, n_prompt);
    fills the next N slots, each step running the model on the last S tokens."""
    S = config.max_seq_len

    def body(i, buf):
        pos = n_prompt + i  # the slot to fill; the model sees tokens [start, pos)
        start = jnp.maximum(pos - S, 0)
        window = jax.lax.dynamic_slice(buf, (start,), (S,))  # (S,)
        logits = forward(params, window[None, :], config)[0]  # (S, V), causal: later slots unseen
        next_logits = jax.lax.dynamic_index_in_dim(logits, pos - 1 - start, keepdims=False)
        token = sample_logits(jax.random.fold_in(key, i), next_logits, temperature, top_k, greedy,
                              top_p)
        return buf.at[pos].set(token)

    return jax.lax.fori_loop(0, max_new_tokens, body, buffer)


def generate(params, config: ModelConfig, prompt_ids, max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, use_cache: bool = True) -> np.ndarray:
    """The prompt's ids followed by ``max_new_tokens`` sampled ids, int32 (P + N,)."""
    return generate_many(params, config, prompt_ids, max_new_tokens, temperature=temperature,
                         top_k=top_k, top_p=top_p, seed=seed, use_cache=use_cache)[0]


def generate_many(params, config: ModelConfig, prompt_ids, max_new_tokens: int, *,
                  temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                  seed: int = 0, num_samples: int = 1, use_cache: bool = True,
                  timing: dict | None = None, log: Callable[[str], None] | None = None) -> np.ndarray:
    """``num_samples`` continuations of one prompt, int32 (num_samples, P + N).

    timing: a dict to fill with TIMING_KEYS: compile_s (the programs are compiled ahead of
    time), prefill_tokens and prefill_s (the prompt's forward, every sample's), decode_tokens
    and decode_s (the draws and the cached steps after the prefill, one token per sample each;
    without the cache every token is a step over the window and prefill_s is None), cache_len
    (the cache's slots; None without the cache), run_s (prefill and decode) and s_per_token
    (run_s / N: the samples run side by side, so this is the time per position).
    log: told what is compiled, before it is.
    """
    if not config.causal:
        raise ValueError("generation needs a causal model (config.causal=True)")
    check_options(max_new_tokens, temperature, top_k, top_p, num_samples)
    prompt = np.asarray(prompt_ids)
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"the prompt must be a non-empty 1-D id sequence, got shape {prompt.shape}")
    validate_ids(prompt, config.vocab_size, "prompt")
    prompt = prompt.astype(np.int32)
    B, N = int(num_samples), int(max_new_tokens)
    if N == 0:
        return np.tile(prompt, (B, 1))
    context = prompt[-config.max_seq_len:]  # the model never sees more than max_seq_len tokens
    key = jax.random.PRNGKey(seed)
    keys = jnp.stack([jax.random.fold_in(key, b) for b in range(B)])  # (B, 2)
    draw = dict(top_k=int(top_k or 0), greedy=temperature == 0, top_p=float(1.0 if top_p is None else top_p))
    temp = jnp.float32(temperature)  # 0: greedy (static above), the division never runs
    sample = _sample_cached if use_cache else _sample_uncached
    new, times = sample(params, config, context, N, keys, temp, draw, log or (lambda line: None))
    run_s = (times["prefill_s"] or 0.0) + times["decode_s"]
    if timing is not None:
        timing.update(times, run_s=run_s, s_per_token=run_s / N)
    return np.concatenate([np.tile(prompt, (B, 1)), new[:, :N]], axis=1)


TIMING_KEYS = ("compile_s", "prefill_tokens", "prefill_s", "decode_tokens", "decode_s", "cache_len",
               "run_s", "s_per_token")


def compiled(fn, *args, **static):
    """(``fn``, a jax.jit function, lowered and compiled for ``args`` (arrays or
    ShapeDtypeStructs) and ``static``, the seconds it took; JAX keeps what it compiled, so
    the same shapes again take ~0 s)."""
    t0 = time.perf_counter()
    executable = fn.lower(*args, **static).compile()
    return executable, time.perf_counter() - t0


def _timed(fn, *args):
    """(fn(*args) once ready, seconds)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


def _sample_cached(params, config, context, N, keys, temp, draw, log):
    """The new tokens (B, N) over a cache of round_up(P + N) slots (at most max_seq_len), and
    their timing: one prefill of round_up(P) slots, then N - 1 cached steps."""
    B, P = keys.shape[0], len(context)
    config = cache_config(config, P + N)
    S = config.max_seq_len
    window = np.zeros((B, S), np.int32)
    window[:, :P] = context
    pre = dict(config=config, prefill=min(round_up(P), S))
    pre_args = (params, jnp.asarray(window), jnp.int32(P))
    log(f"compiling the sampler: a prefill of {pre['prefill']} positions, a cache of {S} slots")
    prefill, compile_s = compiled(_prefill_many, *pre_args, **pre)
    (last, cache), prefill_s = _timed(prefill, *pre_args)
    dec_args = (params, last, pre_args[1], cache, jnp.int32(P), keys, temp)
    decode, seconds = compiled(_decode_many, *dec_args, config=config, max_new_tokens=N, **draw)
    new, decode_s = _timed(decode, *dec_args)
    return np.asarray(new), dict(compile_s=compile_s + seconds, prefill_tokens=B * P, prefill_s=prefill_s,
                                 decode_tokens=B * (N - 1), decode_s=decode_s, cache_len=S)


def _sample_uncached(params, config, context, N, keys, temp, draw, log):
    """The reference: each sample after the other, every token a step over the window."""
    B, S = keys.shape[0], config.max_seq_len
    buffer = np.zeros(S + N, np.int32)
    buffer[: len(context)] = context
    args = (params, jnp.asarray(buffer), jnp.int32(len(context)), keys[0], temp)
    log(f"compiling the sampler: the whole window of {S} positions per token (no cache)")
    loop, compile_s = compiled(_sample_loop, *args, config=config, max_new_tokens=N, **draw)
    rows, decode_s = [], 0.0
    for b in range(B):
        row, seconds = _timed(loop, *args[:3], keys[b], temp)
        rows.append(np.asarray(row)[len(context):])
        decode_s += seconds
    return np.stack(rows), dict(compile_s=compile_s, prefill_tokens=0, prefill_s=None,
                                decode_tokens=B * N, decode_s=decode_s, cache_len=None)
