"""Sampling tokens from a trained model's params (text from a run folder: text.py).

With the key/value cache (the default), a prompt is run once (a prefill of the
last ``max_seq_len`` = S prompt tokens, padded to S, so any prompt compiles once)
and then each new token is one step of the model on that token alone, inside one
jitted ``lax.fori_loop`` whose carry holds the cache (jaxformer/model/kv_cache.py).

The sliding rule past S: the cache holds at most S tokens, in slots 0..S-1, and
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

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.model.checks import check_int, check_number
from jaxformer.model.config import ModelConfig
from jaxformer.model.kv_cache import forward_cached, init_cache
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


_STATIC = ("config", "max_new_tokens", "top_k", "greedy", "top_p")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _sample_cached(params, window, n_context, keys, temperature, *, config: ModelConfig,
                   max_new_tokens: int, top_k: int, greedy: bool, top_p: float):
    """window int32 (B, S): the context in slots [0, n_context), zeros after; keys (B, 2).
    Returns the new tokens int32 (B, N): one prefill, then one cached step per token."""
    S = config.max_seq_len
    keep = max(S // 2, 1)  # the context kept when the cache is full
    B = window.shape[0]
    cache = init_cache(config, B, params["tok_embed"].dtype)
    logits, cache = forward_cached(params, window, cache, 0, config)  # prefill (B, S, V)
    last = jax.lax.dynamic_index_in_dim(logits, n_context - 1, axis=1, keepdims=False)  # (B, V)

    def draw(i, logits):
        step_keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)
        return _sample_rows(step_keys, logits, temperature, top_k, greedy, top_p)

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
        out, last, window, cache, n = carry
        tok = out[:, i - 1]  # the token sampled last step goes into the cache
        last, window, cache, n = jax.lax.cond(n < S, feed, refill, tok, window, cache, n)
        return out.at[:, i].set(draw(i, last)), last, window, cache, n

    out = jnp.zeros((B, max_new_tokens), jnp.int32).at[:, 0].set(draw(0, last))
    carry = (out, last, window, cache, jnp.asarray(n_context, jnp.int32))
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
                  timing: dict | None = None) -> np.ndarray:
    """``num_samples`` continuations of one prompt, int32 (num_samples, P + N).

    timing: a dict to fill with compile_s (the cached sampler is compiled ahead of
    time; None without the cache, whose run_s then includes compiling), run_s (all
    tokens of all samples) and s_per_token (run_s / N: the samples run side by
    side, so this is the time per generated position).
    """
    if not config.causal:
        raise ValueError("generation needs a causal model (config.causal=True)")
    check_options(max_new_tokens, temperature, top_k, top_p, num_samples)
    prompt = np.asarray(prompt_ids)
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"the prompt must be a non-empty 1-D id sequence, got shape {prompt.shape}")
    validate_ids(prompt, config.vocab_size, "prompt")
    prompt = prompt.astype(np.int32)
    B, N, S = int(num_samples), int(max_new_tokens), config.max_seq_len
    if N == 0:
        return np.tile(prompt, (B, 1))
    context = prompt[-S:]  # the model never sees more than S tokens
    key = jax.random.PRNGKey(seed)
    keys = jnp.stack([jax.random.fold_in(key, b) for b in range(B)])  # (B, 2)
    static = dict(config=config, max_new_tokens=N, top_k=int(top_k or 0),
                  greedy=temperature == 0, top_p=float(1.0 if top_p is None else top_p))
    temp = jnp.float32(temperature)  # 0: greedy (static above), the division never runs
    if use_cache:
        window = np.zeros((B, S), np.int32)
        window[:, : len(context)] = context
        fn, args = _sample_cached, (params, jnp.asarray(window), jnp.int32(len(context)), keys, temp)
    else:
        buffer = np.zeros(S + N, np.int32)
        buffer[: len(context)] = context

        def fn(params, buffer, n, keys, temp, **static):  # one sample after another
            return jnp.stack([_sample_loop(params, buffer, n, keys[b], temp, **static)
                              [len(context):] for b in range(B)])

        args = (params, jnp.asarray(buffer), jnp.int32(len(context)), keys, temp)
    if timing is None:
        new = np.asarray(fn(*args, **static))
    else:
        t0 = time.perf_counter()
        compiled = fn.lower(*args, **static).compile() if use_cache else functools.partial(fn, **static)
        t1 = time.perf_counter()
        new = np.asarray(jax.block_until_ready(compiled(*args)))
        t2 = time.perf_counter()
        timing.update(compile_s=t1 - t0 if use_cache else None, run_s=t2 - t1,
                      s_per_token=(t2 - t1) / N)
    new = new[:, :N]
    return np.concatenate([np.tile(prompt, (B, 1)), new], axis=1)
