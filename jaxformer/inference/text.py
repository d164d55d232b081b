"""Text from a run folder: load its newest checkpoint that verifies (or a given step)
through the checkpoints room (a LoRA run's adapters merged into its frozen base), encode the
prompt with the run's tokenizer, sample (generate.py) and decode. ``run_chat`` finds the chat
template and stop ids a run was trained with, for ``generate --run --chat``."""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxformer.checkpoints.runs import load_run
from jaxformer.formats.hf import ModelChat
from jaxformer.formats.run_source import run_chat as chat_source
from jaxformer.inference.generate import check_options, generate_many
from jaxformer.model.config import ModelConfig
from jaxformer.training.adapters import model_params
from jaxformer.training.settings import TrainSettings
from jaxformer.training.step import state_template


class RunModel(NamedTuple):
    """The model a run's checkpoint stands for, ready to sample."""
    params: dict  # a LoRA run's adapters merged into its frozen base
    config: ModelConfig
    tokenizer: object  # the run's own (data.Tokenizer)
    meta: dict  # the checkpoint's meta (its step, settings, ...)


def load_run_model(run_dir, step: int | None = None, model: dict | None = None,
                   log: Callable[[str], None] | None = None) -> RunModel:
    """The newest checkpoint of ``run_dir`` that verifies (or ``step``); ``model``: ModelConfig
    fields to change that keep the params' shapes (e.g. attention_impl, compute_dtype).
    ``log``: told when a LoRA run's frozen base is read."""
    params, config, tokenizer, meta = load_run(run_dir, state_template, step, model)
    settings = meta.get("settings") or {}
    if log and settings.get("lora_rank"):
        log(f"reading the frozen base {settings.get('lora_base') or '(the seed init)'} to merge "
            f"the rank-{settings['lora_rank']} adapters of step {meta['step']} into")
    # a LoRA run's base is read as host arrays: onto the device once, not at every step
    params = jax.tree_util.tree_map(jnp.asarray, model_params(params, config, meta))
    return RunModel(params, config, tokenizer, meta)


def run_chat(meta: dict, tokenizer) -> tuple[ModelChat, str]:
    """(the chat template and stop ids a run was trained with, in its ``tokenizer``; where they
    came from: its frozen base, the model whose tokenizer it reads, or its chat data), from a
    checkpoint's ``meta``; ValueError naming what is missing."""
    if not hasattr(tokenizer, "tokenizer"):  # byte, char: no model's tokenizer, no template
        raise ValueError(f"--chat: this run's {type(tokenizer).__name__} has no chat template (a run "
                         "over a model from --init-from, or over chat data, has one); use --prompt")
    chat, where = chat_source(TrainSettings.from_dict(meta["settings"]), tokenizer)
    if chat is None:
        raise ValueError(f"--chat: this run has no chat template ({where}); use --prompt")
    return chat, where


def encode_prompt(tokenizer, prompt: str):
    """The prompt's ids in the run's tokenizer; ValueError for an empty or unencodable one."""
    if not prompt:
        raise ValueError("the prompt is empty; give at least one character")
    try:
        return tokenizer.encode(prompt)
    except ValueError as e:
        raise ValueError(f"the prompt cannot be encoded by this run's tokenizer: {e}") from None


def sample_text(run_dir, prompt: str, max_new_tokens: int = 200, *, temperature: float = 0.8,
                top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                step: int | None = None, model: dict | None = None) -> str:
    """Load a run's checkpoint and return ``prompt`` followed by the sampled text
    (``model``: ModelConfig fields to change that keep the params' shapes, e.g.
    attention_impl, compute_dtype)."""
    return sample_texts(run_dir, prompt, max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, seed=seed, step=step, model=model)[0]


def sample_texts(run_dir, prompt: str, max_new_tokens: int = 200, *, temperature: float = 0.8,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 step: int | None = None, num_samples: int = 1, use_cache: bool = True,
                 timing: dict | None = None, model: dict | None = None,
                 on_load: Callable[[dict], None] | None = None, loaded: RunModel | None = None,
                 log: Callable[[str], None] | None = None) -> list[str]:
    """``num_samples`` texts: ``prompt`` followed by what the run's model samples.
    ``on_load``: called with the loaded checkpoint's meta (its ``step`` among them);
    ``loaded``: the run's model when it is loaded already; ``log``: told what is read and
    compiled, before it is."""
    check_options(max_new_tokens, temperature, top_k, top_p, num_samples)
    if loaded is None:
        loaded = load_run_model(run_dir, step, model, log)
    if on_load:
        on_load(loaded.meta)
    ids = encode_prompt(loaded.tokenizer, prompt)
    out = generate_many(loaded.params, loaded.config, ids, max_new_tokens, temperature=temperature,
                        top_k=top_k, top_p=top_p, seed=seed, num_samples=num_samples, use_cache=use_cache,
                        timing=timing, log=log)
    return [loaded.tokenizer.decode(row) for row in out]
