"""Text from a run folder: load its newest checkpoint that verifies (or a given step)
through the checkpoints room, encode the prompt with the run's tokenizer, sample
(generate.py) and decode."""

from __future__ import annotations

from typing import Callable

from jaxformer.checkpoints.runs import load_run
from jaxformer.inference.generate import check_options, generate_many
from jaxformer.training.adapters import model_params
from jaxformer.training.step import state_template


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
                 on_load: Callable[[dict], None] | None = None) -> list[str]:
    """``num_samples`` texts: ``prompt`` followed by what the run's model samples.
    ``on_load``: called with the loaded checkpoint's meta (its ``step`` among them)."""
    check_options(max_new_tokens, temperature, top_k, top_p, num_samples)
    params, config, tokenizer, meta = load_run(run_dir, state_template, step, model)
    params = model_params(params, config, meta)  # a LoRA run: its adapters merged into the base
    if on_load:
        on_load(meta)
    if not prompt:
        raise ValueError("the prompt is empty; give at least one character")
    try:
        ids = tokenizer.encode(prompt)
    except ValueError as e:
        raise ValueError(f"the prompt cannot be encoded by this run's tokenizer: {e}") from None
    out = generate_many(params, config, ids, max_new_tokens, temperature=temperature, top_k=top_k,
                        top_p=top_p, seed=seed, num_samples=num_samples, use_cache=use_cache,
                        timing=timing)
    return [tokenizer.decode(row) for row in out]
