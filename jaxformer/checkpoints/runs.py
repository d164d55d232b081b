"""Run folders read back: a checkpoint's state with the model config, tokenizer and
meta it was saved with. Sampling (``jaxformer generate``) and diagnosis
(``jaxformer diagnose``) load runs from here.

The shape of the state is the caller's: ``template(config, meta)`` returns the
abstract state (a pytree of ``jax.ShapeDtypeStruct``) the checkpoint must hold, e.g.
``jaxformer.training.step.state_template`` for a TrainState. It lands on the first
device, whatever mesh wrote it. Without ``step``, the newest checkpoint that
verifies is loaded and each damaged one skipped is reported in one line.

Sampling and diagnosis read the params only (``load_params``, ``load_run``): the
optimizer state (twice the params with Adam) is never restored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxformer.checkpoints.checkpoint import (all_steps, checkpoint_dir, load_newest_good, read_meta,
                                              restore, restore_params, warn)
from jaxformer.checkpoints.errors import CheckpointError
from jaxformer.data import Tokenizer, tokenizer_from_dict
from jaxformer.model.config import ModelConfig

Template = Callable[[ModelConfig, dict], Any]  # (config, meta) -> the abstract state

PARAMS_FIELDS = ("step", "params", "data_index")  # the state fields load_params restores


def run_config(meta: dict, where) -> tuple[ModelConfig, Tokenizer, jnp.dtype]:
    """(model config, tokenizer, param dtype) of a checkpoint's ``meta``; CheckpointError
    naming ``where`` (its folder) when they do not parse, ValueError when the params
    are float64 and jax_enable_x64 is off."""
    try:
        config = ModelConfig.from_dict(meta["config"])
        tokenizer = tokenizer_from_dict(meta["tokenizer"])
        dtype = jnp.dtype(meta.get("param_dtype", "float32"))
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {where} has bad meta data: {e}") from None
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError("this run's params are float64: enable jax_enable_x64 to load them")
    return config, tokenizer, dtype


def _load_step(run_dir: Path, step: int, template: Template, fields: tuple[str, ...] | None = None):
    """(state, config, tokenizer, meta) of checkpoint ``step``; with ``fields``, a dict of
    only those fields of the state."""
    meta = read_meta(run_dir, step)
    where = checkpoint_dir(run_dir) / str(step)
    config, tokenizer, _ = run_config(meta, where)
    try:
        shapes = template(config, meta)
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"checkpoint {where} has bad meta data: {e}") from None
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shapes)
    if fields is None:
        return restore(run_dir, target, step), config, tokenizer, meta
    target = {name: getattr(target, name) for name in fields}
    return restore_params(run_dir, target, step), config, tokenizer, meta


def load_state(run_dir, template: Template, step: int | None = None,
               report: Callable[[str], None] | None = warn):
    """(state, config, tokenizer, meta) of a run's checkpoint ``step``, or of its newest
    checkpoint that verifies (each damaged one skipped is given to ``report``)."""
    run_dir = Path(run_dir)
    _, loaded = load_newest_good(run_dir, lambda s: _load_step(run_dir, s, template), step, report)
    return loaded


def load_params(run_dir, template: Template, step: int | None = None,
                report: Callable[[str], None] | None = warn):
    """As ``load_state``, but the state is a dict of its PARAMS_FIELDS (step, params,
    data_index) alone: no optimizer state is read into memory."""
    run_dir = Path(run_dir)
    _, loaded = load_newest_good(run_dir, lambda s: _load_step(run_dir, s, template, PARAMS_FIELDS),
                                 step, report)
    return loaded


def load_run(run_dir, template: Template, step: int | None = None, model: dict | None = None,
             report: Callable[[str], None] | None = warn):
    """(params, config, tokenizer, meta) of the latest checkpoint (or ``step``) of a run;
    without ``step``, the newest checkpoint that verifies (damaged ones are skipped
    with a one-line warning on stderr). ``model``: ModelConfig fields to change that
    keep the params' shapes (e.g. attention_impl, compute_dtype). Params only: the
    optimizer state is not restored."""
    state, config, tokenizer, meta = load_params(run_dir, template, step, report)
    return state["params"], config.replace(**(model or {})), tokenizer, meta


def describe(run_dir) -> str:
    """The run's checkpoint folder and the steps it holds, for messages."""
    steps = all_steps(run_dir)
    return f"{checkpoint_dir(run_dir)} (steps {', '.join(map(str, steps)) or 'none'})"
