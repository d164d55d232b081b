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
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxformer import checkpoint
from jaxformer.config import ModelConfig, get_preset
from jaxformer.metrics import (GRAD_PLOT_FILE, METRICS_FILE, PLOT_FILE, _progress_bar,
                               _truncate_metrics, _write_record, plot_grad_norms, plot_losses,
                               read_metrics)
from jaxformer.settings import (DTYPES, GRAD_SOURCES, RESUMABLE_CHANGES, TrainSettings,
                                diff_fields, keep_schedule, settings_for)
from jaxformer.sharding import make_mesh, mesh_shardings, put_batch
from jaxformer.step import (GradFn, TrainState, _custom_step, _eval_step, _init_fn, _step,
                            grad_source, init_state, make_eval_step, make_train_step)

__all__ = [
    "DTYPES", "GRAD_SOURCES", "METRICS_FILE", "PLOT_FILE", "RESUMABLE_CHANGES",
    "DataChangedError", "NonFiniteLossError", "TrainResult", "TrainSettings", "TrainState", "diff_fields",
    "grad_source", "init_state", "make_eval_step", "make_mesh", "make_train_step",
    "mesh_shardings", "plot_losses", "put_batch", "read_metrics", "settings_for", "train",
]


class NonFiniteLossError(RuntimeError):
    """The loss (or the gradient norm) became NaN or infinite; training stopped."""


class DataChangedError(ValueError):
    """A resumed run's corpus or tokenizer differs from the one it was trained on."""


def _say(message: str) -> None:
    print(message, file=sys.stderr)


def data_fingerprint(corpus: bytes, tokenizer) -> dict:
    """sha256 of the corpus bytes and of the tokenizer's JSON, recorded with the run."""
    tok = json.dumps(tokenizer.to_dict(), sort_keys=True).encode()
    return {"corpus_sha256": hashlib.sha256(corpus).hexdigest(),
            "tokenizer_sha256": hashlib.sha256(tok).hexdigest()}


def check_data(saved: dict | None, now: dict, where, allow_change: bool) -> None:
    """Raise DataChangedError when a recorded fingerprint differs from ``now``
    (a warning instead with ``allow_change``); runs without a record pass."""
    if not saved:
        return
    changed = [k.split("_")[0] for k in ("corpus_sha256", "tokenizer_sha256")
               if k in saved and saved[k] != now[k]]
    if not changed:
        return
    what = " and ".join(changed)
    if allow_change:
        _say(f"warning: the {what} differ(s) from the one the run was trained on; "
             "continuing (--allow-data-change)")
        return
    raise DataChangedError(
        f"the {what} differ(s) from the one the checkpoint in {where} was trained on "
        f"(corpus sha256 {saved.get('corpus_sha256', '?')[:12]} recorded, {now['corpus_sha256'][:12]} "
        "now); pass --allow-data-change (allow_data_change=True) to resume on it anyway")


# ----------------------------------------------------------------------------
# the loop


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    config: ModelConfig
    tokenizer: Any
    records: list  # the metrics.jsonl lines written by this call
    run_dir: Path


def _meta(config: ModelConfig, tokenizer, settings: TrainSettings, fingerprint=None) -> dict:
    meta = {"config": config.to_dict(), "tokenizer": tokenizer.to_dict(),
            "settings": settings.to_dict(), "param_dtype": settings.dtype}
    if fingerprint is not None:
        meta["data"] = fingerprint
    return meta


def _load_data(settings: TrainSettings, tokenizer=None, check=None):
    """(tokenizer, train ids, val ids, fingerprint); a given tokenizer (a resumed run's)
    is kept. ``check(fingerprint)`` runs before the corpus is encoded."""
    from jaxformer import data

    corpus = data.load_corpus(settings.corpus, max_bytes=settings.max_corpus_bytes)
    if tokenizer is None:
        tokenizer = data.make_tokenizer(settings.tokenizer, corpus)
    fingerprint = data_fingerprint(corpus, tokenizer)
    if check is not None:
        check(fingerprint)
    ids = tokenizer.encode(corpus)
    train_ids, val_ids = data.split_train_val(ids, settings.val_fraction)
    return tokenizer, train_ids, val_ids, fingerprint


def train(settings: TrainSettings, out_dir, *, resume: bool = False, progress: bool = True,
          devices=None, grad_fn: GradFn | None = None,
          allow_data_change: bool = False) -> TrainResult:
    """Train for ``settings.steps`` steps in the run folder ``out_dir`` (created).

    resume: continue from the latest checkpoint in ``out_dir``; the losses then equal
    those of an uninterrupted run. ``settings`` may differ from the checkpoint's only
    in RESUMABLE_CHANGES (a CheckpointError names any other differing field).
    A resumed run keeps the schedule horizon it started with unless
    ``settings.schedule_steps`` says otherwise, restores the newest checkpoint that
    verifies (reporting any it skips), and refuses a changed corpus or tokenizer
    (DataChangedError) unless ``allow_data_change``.
    devices: the devices to run data parallel on (default: all visible).
    grad_fn: a gradient source to use instead of the one ``settings.grads`` names.

    Raises ValueError for bad settings or data, CheckpointError for a missing, bad
    or mismatched checkpoint, NonFiniteLossError when the loss stops being finite.
    """
    from jaxformer import data

    settings.validate()
    run_dir = Path(out_dir)
    saved_meta = None
    check = None
    if resume:
        saved_meta = checkpoint.newest_meta(run_dir)
        settings, note = keep_schedule(settings, TrainSettings.from_dict(saved_meta["settings"]))
        if note:
            _say(note)
        tokenizer = data.tokenizer_from_dict(saved_meta["tokenizer"])

        def check(fingerprint):
            check_data(saved_meta.get("data"), fingerprint, checkpoint.checkpoint_dir(run_dir),
                       allow_data_change)

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
    tokenizer, train_ids, val_ids, fingerprint = _load_data(settings, tokenizer, check)
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
        template = state
        from_step, state = checkpoint.load_newest_good(
            run_dir, lambda s: checkpoint.restore(run_dir, template, s))
        _say(f"resuming from checkpoint step {from_step} "
             f"({checkpoint.checkpoint_dir(run_dir) / str(from_step)})")
        for newer in [s for s in checkpoint.all_steps(run_dir) if s > from_step]:
            _say(f"moved the damaged checkpoint of step {newer} to {checkpoint.set_aside(run_dir, newer)}")
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
    meta = _meta(config, tokenizer, settings, fingerprint)
    tokens_per_step = settings.batch_size * settings.seq_len
    records: list[dict] = []
    last_saved = start if resume else None

    def kept() -> str:
        if last_saved is None:
            return "no checkpoint was written"
        return (f"the newest healthy checkpoint is step {last_saved} in "
                f"{checkpoint.checkpoint_dir(run_dir)}")

    def stop(s: int, what: str):
        """NonFiniteLossError for step s, with the layer that made the first non-finite value."""
        from jaxformer.diagnose import diagnose_failure

        cause = diagnose_failure(
            run_dir, last_saved, config, settings, step_fn, batcher, s, devices_key, opt_items)
        return NonFiniteLossError(f"{what}; training stopped, {kept()}. {cause}")

    def save():
        nonlocal last_saved
        try:
            checkpoint.save(run_dir, state, meta, keep=settings.keep_checkpoints)
        except checkpoint.UnhealthyStateError as e:
            raise stop(int(jax.device_get(state.step)), str(e)) from None
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
                raise stop(s, f"non-finite loss at step {s} (loss {metrics['loss']}, gradient "
                              f"norm {metrics['grad_norm']})")
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
                bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
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
            plot_grad_norms(all_records, run_dir / GRAD_PLOT_FILE)
    return TrainResult(state, config, tokenizer, records, run_dir)

