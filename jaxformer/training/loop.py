"""Training: the loop. ``train(settings, out_dir)`` runs a whole run: data,
periodic validation, ``metrics.jsonl``, checkpoints, ``--resume``, a loss-curve PNG
at the end.

The pieces live beside it: ``settings`` (TrainSettings and the preset recipes),
``step`` (TrainState, gradient sources, the jitted step), ``sharding`` (the mesh),
``metrics`` (the run's records and plot). Their public names are re-exported here.

Parallelism comes from JAX's own sharding: a ("data", "fsdp") ``Mesh`` of all
devices (``settings.mesh``, default every device on "data"); the batch is split
over data x fsdp, params and optimizer state over fsdp (sharding.py), and jit
inserts the collectives. One device is the same code with a mesh of one; several
processes (``jax.distributed``) are one job over all their devices.

The loop never waits on the device between steps: the step's metrics stay on
the device until a log line, an evaluation or a checkpoint needs them; then all
metrics since the last fetch come back at once and the first non-finite loss
among them stops the run, naming its step.
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

from jaxformer.checkpoints import checkpoint
from jaxformer.observe import flops
from jaxformer.observe import report
from jaxformer.observe import tb
from jaxformer.model.config import ModelConfig
from jaxformer.training.configfile import CONFIG_FILE, write_config
from jaxformer.observe.metrics import (GRAD_PLOT_FILE, METRICS_FILE, PLOT_FILE, _truncate_metrics,
                                       _write_record, plot_grad_norms, plot_losses, read_metrics)
from jaxformer.training.settings import (DTYPES, GRAD_SOURCES, RESUMABLE_CHANGES, TrainSettings,
                                         config_diff, diff_fields, keep_schedule, settings_for)
from jaxformer.training.sharding import check_batch_size, make_mesh, mesh_shardings, put_batch
from jaxformer.training.step import (GradFn, TrainState, _eval_step, _init_fn, _step, grad_source,
                                     init_state, make_eval_step, make_train_step)

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
    timing: dict = dataclasses.field(default_factory=dict)  # report.StepClock.summary()


def _meta(config: ModelConfig, tokenizer, settings: TrainSettings, fingerprint=None) -> dict:
    meta = {"config": config.to_dict(), "tokenizer": tokenizer.to_dict(),
            "settings": settings.to_dict(), "param_dtype": settings.dtype}
    if fingerprint is not None:
        meta["data"] = fingerprint
    return meta


def _load_data(settings: TrainSettings, tokenizer=None, check=None, log=None):
    """(tokenizer, train ids, val ids, fingerprint); a given tokenizer (a resumed run's)
    is kept. ``check(fingerprint)`` runs before the corpus is encoded; ``log``: a
    function given the lines that describe the data."""
    from jaxformer import data

    corpus = data.load_corpus(settings.corpus, max_bytes=settings.max_corpus_bytes)
    if tokenizer is None:
        tokenizer = data.make_tokenizer(settings.tokenizer, corpus)
    fingerprint = data_fingerprint(corpus, tokenizer)
    if check is not None:
        check(fingerprint)
    ids = tokenizer.encode(corpus)
    train_ids, val_ids = data.split_train_val(ids, settings.val_fraction)
    if log:
        source = data.describe_corpus(settings.corpus, settings.max_corpus_bytes, len(corpus))
        for line in report.data_lines(source, tokenizer, len(train_ids), len(val_ids)):
            log(line)
    return tokenizer, train_ids, val_ids, fingerprint


def _check_resume(run_dir: Path, settings: TrainSettings, saved_meta: dict) -> dict:
    """The checkpoint's meta ``saved_meta``, after checking that it fits ``settings``."""
    from jaxformer import data

    tokenizer = data.tokenizer_from_dict(saved_meta["tokenizer"])
    requested = settings.model_config(tokenizer.vocab_size)
    model_diff = config_diff(saved_meta["config"], requested)
    saved = TrainSettings.from_dict(saved_meta["settings"]).to_dict()
    settings_diff = diff_fields(saved, settings.to_dict(), ignore=RESUMABLE_CHANGES | {"model"})
    problems = []
    if model_diff:
        problems.append(f"model config differs in {'; '.join(model_diff)}")
    if settings_diff:
        problems.append(f"train settings differ in {'; '.join(settings_diff)}")
    if problems:
        raise checkpoint.CheckpointError(
            f"the checkpoint in {checkpoint.checkpoint_dir(run_dir)} does not match the "
            f"requested run: {'. '.join(problems)}"
        )
    return saved_meta


def _first_non_finite(pending: list) -> tuple[int, dict] | None:
    """(step, metrics) of the first non-finite loss or gradient norm among the
    fetched ``pending`` (step, metrics) pairs."""
    for s, m in pending:
        if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
            return s, m
    return None


def train(settings: TrainSettings, out_dir, *, resume: bool = False, progress: bool = True,
          devices=None, grad_fn: GradFn | None = None, log=None,
          allow_data_change: bool = False) -> TrainResult:
    """Train for ``settings.steps`` steps in the run folder ``out_dir`` (created).

    resume: continue from the latest checkpoint in ``out_dir``; the losses then equal
    those of an uninterrupted run (on any mesh). ``settings`` may differ from the
    checkpoint's only in RESUMABLE_CHANGES (a CheckpointError names any other
    differing field; the model is compared field by field after resolving overrides).
    A resumed run keeps the schedule horizon it started with unless
    ``settings.schedule_steps`` says otherwise, restores the newest checkpoint that
    verifies (reporting any it skips), and refuses a changed corpus or tokenizer
    (DataChangedError) unless ``allow_data_change``.
    devices: the devices of the mesh (default: all devices of all processes), laid
    out as ``settings.mesh`` says.
    grad_fn: a gradient source to use instead of the one ``settings.grads`` names.
    log: a function given human-readable lines (settings, data, compile time, the
    summary; report.py); None: silent.

    Raises ValueError for bad settings, data or mesh, CheckpointError for a missing,
    bad or mismatched checkpoint, NonFiniteLossError when the loss stops being finite.
    """
    from jaxformer import data

    settings.validate()
    run_dir = Path(out_dir)
    tokenizer = None
    check = None
    if resume:
        saved_meta = checkpoint.newest_meta(run_dir)
        settings, note = keep_schedule(settings, TrainSettings.from_dict(saved_meta["settings"]))
        if note:
            _say(note)
        tokenizer = data.tokenizer_from_dict(_check_resume(run_dir, settings, saved_meta)["tokenizer"])

        def check(fingerprint):
            check_data(saved_meta.get("data"), fingerprint, checkpoint.checkpoint_dir(run_dir),
                       allow_data_change)
    elif checkpoint.all_steps(run_dir):
        raise ValueError(
            f"{run_dir} already holds checkpoints; resume it (--resume) or choose another folder"
        )
    tokenizer, train_ids, val_ids, fingerprint = _load_data(settings, tokenizer, check, log)
    config = settings.model_config(tokenizer.vocab_size)

    mesh = make_mesh(devices, settings.mesh)
    check_batch_size(settings.batch_size, mesh)
    batcher = data.Batcher(train_ids, settings.batch_size, settings.seq_len, settings.seed)
    val_batches = []
    if len(val_ids) > settings.seq_len:
        val_batches = list(data.sequential_batches(
            val_ids, settings.batch_size, settings.seq_len, settings.eval_batches))

    opt_items = tuple(sorted(settings.optimizer_kwargs().items()))
    mesh_key = (tuple(mesh.devices.flat), tuple(mesh.devices.shape))
    state = _init_fn(config, settings.dtype, opt_items, *mesh_key)(settings.seed)
    if resume:
        template = state
        from_step, state = checkpoint.load_newest_good(
            run_dir, lambda s: checkpoint.restore(run_dir, template, s))
        _say(f"resuming from checkpoint step {from_step} "
             f"({checkpoint.checkpoint_dir(run_dir) / str(from_step)})")
        for newer in [s for s in checkpoint.all_steps(run_dir) if s > from_step]:
            _say(f"moved the damaged checkpoint of step {newer} to {checkpoint.set_aside(run_dir, newer)}")
    step_fn = _step(config, grad_fn or settings.grads, opt_items, settings.dtype, *mesh_key)
    eval_fn = _eval_step(config, *mesh_key)
    if log:
        _log_settings(log, settings, config, state.params, mesh)
    val_device = [put_batch(b, mesh) for b in val_batches]

    def evaluate(params) -> float:
        losses = [eval_fn(params, b) for b in val_device]
        return float(np.mean(jax.device_get(losses)))

    main = jax.process_index() == 0  # only the first process writes the run's records
    metrics_path = run_dir / METRICS_FILE
    start = int(jax.device_get(state.step))
    index = int(jax.device_get(state.data_index))
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            _truncate_metrics(metrics_path, start)
        elif metrics_path.exists():
            metrics_path.unlink()
        write_config(run_dir / CONFIG_FILE, settings, config)
    meta = _meta(config, tokenizer, settings, fingerprint)
    tokens_per_step = settings.batch_size * settings.seq_len
    records: list[dict] = []
    last_saved = start if resume else None
    events = tb.open_event_log(run_dir, start + 1 if resume else None, log) if main else None
    clock = report.StepClock(tokens_per_step)
    pending: list = []  # (step, metrics on the device) since the last fetch

    def fetch() -> dict:
        """The metrics since the last fetch, brought to the host in one transfer; the
        first non-finite one stops the run. Returns the latest step's."""
        fetched = [(s, {k: float(v) for k, v in m.items()})
                   for s, m in zip([s for s, _ in pending], jax.device_get([m for _, m in pending]))]
        pending.clear()
        compile_s = clock.step_done(len(fetched))
        if compile_s is not None and log:
            log(report.compile_line(compile_s, fetched[0][0]))
        bad = _first_non_finite(fetched)
        if bad is not None:
            s, m = bad
            raise stop(s, f"non-finite loss at step {s} (loss {m['loss']}, gradient norm "
                          f"{m['grad_norm']})")
        return fetched[-1][1]

    def kept() -> str:
        if last_saved is None:
            return "no checkpoint was written"
        return (f"the newest healthy checkpoint is step {last_saved} in "
                f"{checkpoint.checkpoint_dir(run_dir)}")

    def stop(s: int, what: str):
        """NonFiniteLossError for step s, with the layer that made the first non-finite value."""
        from jaxformer.training.diagnose import diagnose_failure

        cause = diagnose_failure(
            run_dir, last_saved, config, settings, step_fn, batcher, s, mesh_key, opt_items)
        return NonFiniteLossError(f"{what}; training stopped, {kept()}. {cause}")

    def save():
        nonlocal last_saved
        try:
            checkpoint.save(run_dir, state, meta, keep=settings.keep_checkpoints)
        except checkpoint.UnhealthyStateError as e:
            raise stop(int(jax.device_get(state.step)), str(e)) from None
        last_saved = int(jax.device_get(state.step))

    def mfu(tokens_per_s: float) -> str:
        """Model FLOPs utilization of ``tokens_per_s`` on this run's devices (flops.py)."""
        return flops.mfu_text(tokens_per_s, config, settings.seq_len,
                              param_dtype=settings.dtype,
                              n_devices=mesh.devices.size)

    bar = report.Progress(start, settings.steps, progress and main)
    t_last, steps_since = time.perf_counter(), 0
    try:
        for s in range(start + 1, settings.steps + 1):  # s: the step count after this step
            batch = put_batch(batcher.batch(index), mesh)
            state, metrics = step_fn(state, batch)  # dispatched; nothing waits for it here
            pending.append((s, metrics))
            index += 1
            steps_since += 1
            last = s == settings.steps
            do_eval = bool(val_device) and (last or (settings.eval_every and s % settings.eval_every == 0))
            do_ckpt = last or (settings.ckpt_every and s % settings.ckpt_every == 0)
            if do_eval or last or s == start + 1 or s % settings.log_every == 0:
                host = fetch()
                now = time.perf_counter()
                record = {"step": s, **host,
                          "tokens_per_s": tokens_per_step * steps_since / max(now - t_last, 1e-9)}
                if not records:  # the first step of this call: its time is mostly compiling
                    record["compile_s"] = clock.compile_s
                if resume and not records:
                    record["resumed"] = True
                if do_eval:
                    with clock.paused():
                        record["val_loss"] = evaluate(state.params)
                    record.update(report.val_bits(record["val_loss"], tokenizer.kind))
                if main:
                    _write_record(metrics_path, record)
                    if events:
                        events.write(record)
                records.append(record)
                bar.set_postfix(loss=f"{host['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                                mfu=mfu(record["tokens_per_s"]))
                t_last, steps_since = time.perf_counter(), 0
            bar.update(1)
            if do_ckpt:
                if pending:  # never checkpoint a state past a non-finite loss
                    fetch()
                t_save = time.perf_counter()
                with clock.paused():
                    save()
                t_last += time.perf_counter() - t_save  # tokens/s counts training time only
        if pending:
            fetch()
    finally:
        bar.close()
        if events:
            events.close()
        if main:
            all_records = read_metrics(run_dir)
            if all_records:
                plot_losses(all_records, run_dir / PLOT_FILE)
                plot_grad_norms(all_records, run_dir / GRAD_PLOT_FILE)
    timing = clock.summary()
    if log:
        steady = timing.get("steady_tokens_per_s")
        log(report.summary_line(timing) + (f"; steady-state MFU {mfu(steady)}" if steady else ""))
    return TrainResult(state, config, tokenizer, records, run_dir, timing)


def _log_settings(log, settings, config, params, mesh) -> None:
    from jaxformer.model.params import count_params
    from jaxformer.training.settings import recipe_notes

    devices = f"{mesh.devices.size} {mesh.devices.flat[0].platform} device(s), mesh {dict(mesh.shape)}"
    for line in report.settings_block(settings, config, count_params(params), devices,
                                      recipe_notes(settings)):
        log(line)
