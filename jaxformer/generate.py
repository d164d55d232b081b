"""Sampling text from a trained model.

The whole sampling loop is one jitted ``lax.fori_loop``: tokens live in a fixed
buffer of ``max_seq_len + max_new_tokens`` slots and each step runs the model on
the window of the last ``max_seq_len`` tokens (a fixed shape), so a prompt of
any length compiles once per ``max_new_tokens``. Temperature 0 is greedy
decoding; ``top_k`` keeps only the k most likely tokens before sampling.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import checkpoint
from jaxformer.config import ModelConfig
from jaxformer.data import validate_ids
from jaxformer.model import forward
from jaxformer.optim import make_optimizer
from jaxformer.params import init_params


def _check_options(max_new_tokens, temperature, top_k):
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer))
                              or top_k < 0):
        raise ValueError(f"top_k must be a non-negative integer (0: no limit), got {top_k!r}")


def sample_logits(key, logits, temperature, top_k: int, greedy: bool):
    """One token id from logits (V,): argmax when greedy, else a draw from
    softmax(logits / temperature) restricted to the top_k largest (0: all)."""
    if greedy:
        return jnp.argmax(logits).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][-1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "max_new_tokens", "top_k", "greedy"))
def _sample_loop(params, buffer, n_prompt, key, temperature, *, config: ModelConfig,
                 max_new_tokens: int, top_k: int, greedy: bool):
    """buffer int32 (S + N,) holds the prompt in [0, n_prompt); fills the next N slots."""
    S = config.max_seq_len

    def body(i, buf):
        pos = n_prompt + i  # the slot to fill; the model sees tokens [start, pos)
        start = jnp.maximum(pos - S, 0)
        window = jax.lax.dynamic_slice(buf, (start,), (S,))  # (S,)
        logits = forward(params, window[None, :], config)[0]  # (S, V), causal: later slots unseen
        next_logits = jax.lax.dynamic_index_in_dim(logits, pos - 1 - start, keepdims=False)
        token = sample_logits(jax.random.fold_in(key, i), next_logits, temperature, top_k, greedy)
        return buf.at[pos].set(token)

    return jax.lax.fori_loop(0, max_new_tokens, body, buffer)


def generate(params, config: ModelConfig, prompt_ids, max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int | None = None, seed: int = 0) -> np.ndarray:
    """The prompt's ids followed by ``max_new_tokens`` sampled ids, int32 (P + N,)."""
    if not config.causal:
        raise ValueError("generation needs a causal model (config.causal=True)")
    _check_options(max_new_tokens, temperature, top_k)
    prompt = np.asarray(prompt_ids)
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"the prompt must be a non-empty 1-D id sequence, got shape {prompt.shape}")
    validate_ids(prompt, config.vocab_size, "prompt")
    if max_new_tokens == 0:
        return prompt.astype(np.int32)
    S = config.max_seq_len
    context = prompt[-S:]  # the model never sees more than S tokens
    buffer = np.zeros(S + max_new_tokens, np.int32)
    buffer[: len(context)] = context
    out = _sample_loop(
        params, jnp.asarray(buffer), jnp.int32(len(context)), jax.random.PRNGKey(seed),
        jnp.float32(max(temperature, 1e-6)), config=config, max_new_tokens=int(max_new_tokens),
        top_k=int(top_k or 0), greedy=temperature == 0,
    )
    new = np.asarray(out)[len(context): len(context) + max_new_tokens]
    return np.concatenate([prompt.astype(np.int32), new])


def load_state(run_dir, step: int | None = None, report=checkpoint.warn):
    """(state, config, tokenizer, meta) of a run's checkpoint ``step``, or of its newest
    checkpoint that verifies (each damaged one skipped is reported in one line)."""
    run_dir = Path(run_dir)
    _, loaded = checkpoint.load_newest_good(run_dir, lambda s: _load_step(run_dir, s), step, report)
    return loaded


def _load_step(run_dir: Path, step: int):
    from jaxformer import data
    from jaxformer.train import TrainSettings, init_state

    meta = checkpoint.read_meta(run_dir, step)
    path = checkpoint.checkpoint_dir(run_dir) / str(step)
    try:
        config = ModelConfig.from_dict(meta["config"])
        tokenizer = data.tokenizer_from_dict(meta["tokenizer"])
        settings = TrainSettings.from_dict(meta["settings"])
        dtype = jnp.dtype(meta.get("param_dtype", "float32"))
    except (ValueError, TypeError, KeyError) as e:
        raise checkpoint.CheckpointError(f"checkpoint {path} has bad meta data: {e}") from None
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError("this run's params are float64: enable jax_enable_x64 to load them")
    optimizer = make_optimizer(**settings.optimizer_kwargs())
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    template = jax.eval_shape(
        lambda: init_state(init_params(jax.random.PRNGKey(0), config, dtype), optimizer))
    template = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), template)
    state = checkpoint.restore(run_dir, template, step)
    return state, config, tokenizer, meta


def load_run(run_dir, step: int | None = None):
    """(params, config, tokenizer, meta) of the latest checkpoint (or ``step``) of a run;
    without ``step``, the newest checkpoint that verifies (damaged ones are skipped
    with a one-line warning on stderr)."""
    state, config, tokenizer, meta = load_state(run_dir, step)
    return state.params, config, tokenizer, meta


def sample_text(run_dir, prompt: str, max_new_tokens: int = 200, *, temperature: float = 0.8,
                top_k: int | None = None, seed: int = 0, step: int | None = None) -> str:
    """Load a run's checkpoint and return ``prompt`` followed by the sampled text."""
    _check_options(max_new_tokens, temperature, top_k)
    params, config, tokenizer, _ = load_run(run_dir, step)
    if not prompt:
        raise ValueError("the prompt is empty; give at least one character")
    try:
        ids = tokenizer.encode(prompt)
    except ValueError as e:
        raise ValueError(f"the prompt cannot be encoded by this run's tokenizer: {e}") from None
    out = generate(params, config, ids, max_new_tokens, temperature=temperature,
                   top_k=top_k, seed=seed)
    return tokenizer.decode(out)
