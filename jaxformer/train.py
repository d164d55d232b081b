"""Training: the loop. ``train(settings, out_dir)`` runs a whole run: data,
periodic validation, ``metrics.jsonl``, checkpoints, ``--resume``, a loss-curve PNG
at the end.

The pieces live beside it: ``settings`` (TrainSettings and the preset recipes),
``step`` (TrainState, gradient sources, the jitted step), ``sharding`` (the mesh),
``metrics`` (the run's records and plot). Their public names are re-exported here.

Data parallelism comes from JAX's own sharding: the batch is split along its
first axis over a one-axis ``Mesh`` of all visible devices, params and optimizer
state are replicated, and jit inserts the gradient all-reduce. One device is the
same code with a mesh of one.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxformer import checkpoint, flops
from jaxformer.config import ModelConfig, get_preset
from jaxformer.metrics import (METRICS_FILE, PLOT_FILE, _progress_bar, _truncate_metrics,
                               _write_record, plot_losses, read_metrics)
from jaxformer.settings import (DTYPES, GRAD_SOURCES, RESUMABLE_CHANGES, TrainSettings,
                                diff_fields, settings_for)
from jaxformer.sharding import make_mesh, mesh_shardings, put_batch
from jaxformer.step import (GradFn, TrainState, _custom_step, _eval_step, _init_fn, _step,
                            grad_source, init_state, make_eval_step, make_train_step)

__all__ = [
    "DTYPES", "GRAD_SOURCES", "METRICS_FILE", "PLOT_FILE", "RESUMABLE_CHANGES",
    "NonFiniteLossError", "TrainResult", "TrainSettings", "TrainState", "diff_fields",
    "grad_source", "init_state", "make_eval_step", "make_mesh", "make_train_step",
    "mesh_shardings", "plot_losses", "put_batch", "read_metrics", "settings_for", "train",
]


class NonFiniteLossError(RuntimeError):
    """The loss (or the gradient norm) became NaN or infinite; training stopped."""


# ----------------------------------------------------------------------------
# the loop


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    config: ModelConfig
    tokenizer: Any
    records: list  # the metrics.jsonl lines written by this call
    run_dir: Path


def _meta(config: ModelConfig, tokenizer, settings: TrainSettings) -> dict:
    return {"config": config.to_dict(), "tokenizer": tokenizer.to_dict(),
            "settings": settings.to_dict(), "param_dtype": settings.dtype}


def _load_data(settings: TrainSettings, tokenizer=None):
    """(tokenizer, train ids, val ids); a given tokenizer (a resumed run's) is kept."""
    from jaxformer import data

    corpus = data.load_corpus(settings.corpus, max_bytes=settings.max_corpus_bytes)
    if tokenizer is None:
        tokenizer = data.make_tokenizer(settings.tokenizer, corpus)
    ids = tokenizer.encode(corpus)
    train_ids, val_ids = data.split_train_val(ids, settings.val_fraction)
    return tokenizer, train_ids, val_ids


def train(settings: TrainSettings, out_dir, *, resume: bool = False, progress: bool = True,
          devices=None, grad_fn: GradFn | None = None) -> TrainResult:
    """Train for ``settings.steps`` steps in the run folder ``out_dir`` (created).

    resume: continue from the latest checkpoint in ``out_dir``; the losses then equal
    those of an uninterrupted run. ``settings`` may differ from the checkpoint's only
    in RESUMABLE_CHANGES (a CheckpointError names any other differing field).
    devices: the devices to run data parallel on (default: all visible).
    grad_fn: a gradient source to use instead of the one ``settings.grads`` names.

    Raises ValueError for bad settings or data, CheckpointError for a missing, bad
    or mismatched checkpoint, NonFiniteLossError when the loss stops being finite.
    """
    from jaxformer import data

    settings.validate()
    run_dir = Path(out_dir)
    saved_meta = None
    if resume:
        saved_meta = checkpoint.read_meta(run_dir)
        tokenizer = data.tokenizer_from_dict(saved_meta["tokenizer"])
        requested = get_preset(settings.preset, vocab_size=tokenizer.vocab_size)
        config_diff = diff_fields(saved_meta["config"], requested.to_dict())
        saved = TrainSettings.from_dict(saved_meta["settings"]).to_dict()
        settings_diff = diff_fields(saved, settings.to_dict(), ignore=RESUMABLE_CHANGES)
        problems = []
        if config_diff:
            problems.append(f"model config differs in {'; '.join(config_diff)}")
        if settings_diff:
            problems.append(f"train settings differ in {'; '.join(settings_diff)}")
        if problems:
            raise checkpoint.CheckpointError(
                f"the checkpoint in {checkpoint.checkpoint_dir(run_dir)} does not match the "
                f"requested run: {'. '.join(problems)}"
            )
    else:
        tokenizer = None
        if checkpoint.all_steps(run_dir):
            raise ValueError(
                f"{run_dir} already holds checkpoints; resume it (--resume) or choose another folder"
            )
    tokenizer, train_ids, val_ids = _load_data(settings, tokenizer)
    config = get_preset(settings.preset, vocab_size=tokenizer.vocab_size)

    mesh = make_mesh(devices)
    n_devices = mesh.devices.size
    if settings.batch_size % n_devices:
        raise ValueError(
            f"batch_size {settings.batch_size} must be divisible by the number of devices ({n_devices})"
        )
    batcher = data.Batcher(train_ids, settings.batch_size, settings.seq_len, settings.seed)
    val_batches = []
    if len(val_ids) > settings.seq_len:
        val_batches = list(data.sequential_batches(
            val_ids, settings.batch_size, settings.seq_len, settings.eval_batches))

    opt_items = tuple(sorted(settings.optimizer_kwargs().items()))
    devices_key = tuple(mesh.devices.flat)
    state = _init_fn(config, settings.dtype, opt_items, devices_key)(settings.seed)
    if resume:
        state = checkpoint.restore(run_dir, state)
    if grad_fn is None:
        step_fn = _step(config, settings.grads, opt_items, devices_key)
    else:
        step_fn = _custom_step(grad_fn, opt_items, devices_key)
    eval_fn = _eval_step(config, devices_key)
    val_device = [put_batch(b, mesh) for b in val_batches]

    def evaluate(params) -> float:
        losses = [eval_fn(params, b) for b in val_device]
        return float(np.mean(jax.device_get(losses)))

    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = run_dir / METRICS_FILE
    start = int(jax.device_get(state.step))
    index = int(jax.device_get(state.data_index))
    if resume:
        _truncate_metrics(metrics_path, start)
    elif metrics_path.exists():
        metrics_path.unlink()
    meta = _meta(config, tokenizer, settings)
    tokens_per_step = settings.batch_size * settings.seq_len
    records: list[dict] = []
    last_saved = start if resume else None

    def save():
        nonlocal last_saved
        checkpoint.save(run_dir, state, meta, keep=settings.keep_checkpoints)
        last_saved = int(jax.device_get(state.step))

    bar = _progress_bar(start, settings.steps, progress)
    t_last, steps_since = time.perf_counter(), 0
    try:
        for s in range(start + 1, settings.steps + 1):  # s: the step count after this step
            batch = batcher.batch(index)
            state, metrics = step_fn(state, batch)
            index += 1
            steps_since += 1
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
                kept = (f"the last checkpoint (step {last_saved}) is kept in "
                        f"{checkpoint.checkpoint_dir(run_dir)}" if last_saved else "no checkpoint was written")
                raise NonFiniteLossError(
                    f"non-finite loss at step {s} (loss {metrics['loss']}, gradient norm "
                    f"{metrics['grad_norm']}); training stopped, {kept}"
                )
            last = s == settings.steps
            do_eval = bool(val_device) and (last or (settings.eval_every and s % settings.eval_every == 0))
            if do_eval or last or s == 1 or s % settings.log_every == 0:
                now = time.perf_counter()
                record = {"step": s, **metrics,
                          "tokens_per_s": tokens_per_step * steps_since / max(now - t_last, 1e-9)}
                if do_eval:
                    record["val_loss"] = evaluate(state.params)
                _write_record(metrics_path, record)
                records.append(record)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                mfu=flops.mfu_text(record["tokens_per_s"], config, settings.seq_len, n_devices=mesh.size))
                t_last, steps_since = time.perf_counter(), 0
            bar.update(1)
            if last or (settings.ckpt_every and s % settings.ckpt_every == 0):
                t_save = time.perf_counter()
                save()
                t_last += time.perf_counter() - t_save  # tokens/s counts training time only
    finally:
        bar.close()
        all_records = read_metrics(run_dir)
        if all_records:
            plot_losses(all_records, run_dir / PLOT_FILE)
    return TrainResult(state, config, tokenizer, records, run_dir)

