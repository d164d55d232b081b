"""Which layer made the first non-finite value.

``diagnose_batch(params, batch, config)`` runs one batch eagerly through the
hand-derived forward and backward of ``manual_grads`` (``value_and_grad`` with a
tap: the blocks run one layer at a time, no autodiff) and records every stage's
output range and every gradient:

    forward:  embed, blocks[l].ln1, blocks[l].attn, blocks[l].attn residual, ...,
              ln_f, head, loss
    backward: the same stages in reverse: loss dlogits, head dw, ..., blocks[0].ln1 dscale, ...

The first stage whose output (or gradient) holds a NaN or an infinity is named,
with the value range of its input, e.g.
``forward: blocks[1].attn output is non-finite; its input has min -2.1, max 2.3, abs max 2.3``.

The stages are those training runs, since they are its own manual layers: the
attention the config names (full or blockwise), its compute_dtype for every product,
and with loss_chunk > 0 one "head + loss" stage that runs both chunk by chunk (no
(B, T, V) logits); with remat "block" each block's forward is recomputed, unseen, in
the backward. ``Diagnosis.settings`` states what ran, and the table's first line
repeats it. The record and the table are jaxformer/observe/diagnosis.py's.

``diagnose_failure`` (called by the training loop when a step's loss or gradient is
non-finite) replays the run from its newest healthy checkpoint to the step before
the failure and diagnoses the failing step's batch; ``diagnose_run`` (the
``jaxformer diagnose`` command) does the same for a checkpoint's next batch.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxformer import data
from jaxformer.checkpoints import checkpoint
from jaxformer.checkpoints.runs import load_params
from jaxformer.model.config import ModelConfig
from jaxformer.model.validate import validate_batch
from jaxformer.observe.diagnosis import Diagnosis, Range, Recorder, Stage, value_range  # noqa: F401
from jaxformer.observe.words import plural
from jaxformer.training.run_data import load_data
from jaxformer.training.settings import TrainSettings
from jaxformer.training.step import StepSpec, init_fn, state_template
from manual_grads.model import value_and_grad


def settings(config: ModelConfig) -> str:
    """The layer implementations and precision diagnose_batch runs for ``config``."""
    attn = {"blockwise": f"blockwise attention (block {config.attention_block})",
            "pallas": "pallas flash attention"}.get(config.attention_impl, "full attention")
    products = f"products in {config.compute_dtype or 'the params dtype'}"
    loss = (f"head + loss in chunks of {config.loss_chunk}" if config.loss_chunk
            else "head and loss over all positions")
    return f"{attn}, {products}, {loss}"


def diagnose_batch(params, batch, config: ModelConfig) -> Diagnosis:
    """Run ``batch`` eagerly through the manual forward and backward, stage by stage;
    see the module docstring. Never under jit: every stage's values are inspected."""
    validate_batch(batch, config)  # as given: a list of ids is named, not converted
    params = jax.tree_util.tree_map(jnp.asarray, params)
    batch = {k: jnp.asarray(batch[k]) for k in ("inputs", "targets", "mask", "segments") if batch.get(k) is not None}
    recorder = Recorder()
    loss, _ = value_and_grad(params, batch, config, tap=recorder)
    return recorder.diagnosis(float(loss), settings(config))


# ----------------------------------------------------------------------------
# after a failed step, and for a saved checkpoint


def diagnose_failure(run_dir, last_saved, spec: StepSpec, settings, step_fn, batcher, step: int) -> str:
    """Where step ``step``'s first non-finite value appeared, and what resuming will do.

    Replays the run from its newest healthy checkpoint (step ``last_saved``, or the
    initial state of ``spec`` when None) with the same compiled ``step_fn`` to the state before
    ``step``, diagnoses that step's batch (``batcher.batch`` is a pure function of the
    batch index), then replays the failing step itself on the same batch
    (``resume_advice``). Never raises: a failed diagnosis says so."""
    try:
        config = spec.config
        state = init_fn(spec)(settings.seed)
        if last_saved is not None:
            state = checkpoint.restore(run_dir, state, last_saved)
        index = int(jax.device_get(state.data_index))
        for _ in range(int(jax.device_get(state.step)), step - 1):
            state, _ = step_fn(state, batcher.batch(index))
            index += 1
        batch = batcher.batch(index)
        diagnosis = diagnose_batch(jax.device_get(state.params), batch, config)
        _, metrics = step_fn(state, batch)
        advice = resume_advice(last_saved, step, settings, jax.device_get(metrics))
        if (diagnosis.first is not None and str(diagnosis.first).startswith("forward")
                and last_saved == step - 1):
            older = [s for s in checkpoint.all_steps(run_dir) if s < last_saved]
            advice += (f" The params of checkpoint step {last_saved} already give a non-finite "
                       "forward, so no setting rescues it: resume from an older checkpoint ("
                       + (f"steps {', '.join(map(str, older))}; move the newer ones out of "
                          f"{checkpoint.checkpoint_dir(run_dir)})" if older else "none is kept)")
                       + " with a lower --lr.")
    except Exception as e:  # noqa: BLE001 - the diagnosis must not hide the failure itself
        return f"(the layer-by-layer diagnosis failed: {type(e).__name__}: {e})"
    if diagnosis.first is None:
        return (f"The manual forward and backward of step {step}'s batch are finite (loss "
                f"{diagnosis.loss:.4g}): the non-finite value came from the gradient source or "
                f"the optimizer update. {advice}")
    return f"Step {step}'s batch, layer by layer: {diagnosis.first}. {advice}"


def resume_advice(last_saved, step: int, settings: TrainSettings, metrics: dict) -> str:
    """What resuming does, from the replay of step ``step`` (its ``metrics``) from the
    checkpoint of step ``last_saved`` (None: the initial state) at the run's settings:
    it passes (a plain --resume continues) or it diverges again (the settings to change)."""
    finite = all(math.isfinite(float(metrics[k])) for k in ("loss", "grad_norm") if k in metrics)
    start = f"checkpoint step {last_saved}" if last_saved is not None else "the initial state"
    if finite:
        how = "a plain --resume continues from it" if last_saved is not None else "a new run may pass it"
        return (f"A replay of step {step} from {start} on the same batch is finite (loss "
                f"{float(metrics['loss']):.4g}): {how}.")
    fix = f"a lower --lr (now {settings.lr:g}, e.g. --lr {settings.lr / 10:g})"
    if settings.clip_norm:
        fix += f" or a tighter --clip-norm (now {settings.clip_norm:g})"
    else:
        fix += ("; gradient-norm clipping (--clip-norm) changes the optimizer state, so it needs "
                "a new run")
    how = "--resume with" if last_saved is not None else "a new run with"
    return (f"Resuming from {start} at these settings diverges again: a replay of step {step} on "
            f"the same batch is non-finite; {how} {fix}.")


def diagnose_run(run_dir, step: int | None = None) -> str:
    """The per-stage table (forward ranges, gradient norms) and the first non-finite
    value for the next training batch of a run's checkpoint (default: the newest
    that verifies). Restores the params alone, not the optimizer state."""
    state, config, tokenizer, meta = load_params(run_dir, state_template, step)
    settings = TrainSettings.from_dict(meta["settings"])
    _, train_ids, _, _ = load_data(settings, tokenizer)
    batcher = data.Batcher(train_ids, settings.batch_size, settings.seq_len, settings.seed)
    index = int(jax.device_get(state["data_index"]))
    diagnosis = diagnose_batch(jax.device_get(state["params"]), batcher.batch(index), config)
    header = (f"{Path(run_dir)}: checkpoint step {meta['step']}, training batch {index} "
              f"({settings.batch_size} x {settings.seq_len} tokens), {plural(config.n_layers, 'block')}")
    return f"{header}\n{diagnosis.table()}"
