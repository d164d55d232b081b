"""Training: the loop. ``train(settings, out_dir)`` runs a whole run: data,
periodic validation, ``metrics.jsonl``, checkpoints, ``--resume``, a loss-curve PNG
at the end. It reads top to bottom: build the data, the state and the step; loop;
report.

The pieces live beside it: ``settings`` (TrainSettings and the preset recipes),
``run_data`` (corpus, tokenizer, batches), ``resume`` (what a resumed run may
change, and the checks), ``step`` (TrainState, gradient sources, the jitted step),
``sharding`` (the mesh), and ``observe.run_log`` (the run's records, bar and plots).

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
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxformer.checkpoints import checkpoint
from jaxformer.data import Prefetcher
from jaxformer.model.config import ModelConfig
from jaxformer.model.params import count_params
from jaxformer.observe import report
from jaxformer.observe.run_log import RunLog, first_non_finite_loss
from jaxformer.training.configfile import CONFIG_FILE, write_config
from jaxformer.training.diagnose import diagnose_failure
from jaxformer.training.memory_check import check_run_memory
from jaxformer.training.resume import check_fresh, checkpoint_meta, restore_newest, resume_settings
from jaxformer.training.run_data import run_data
from jaxformer.training.settings import TrainSettings, recipe_notes
from jaxformer.training.sharding import check_batch_size, local_rows, make_mesh, put_batch
from jaxformer.training.stopping import Interrupted, StopRequests
from jaxformer.training.step import (GradFn, TrainState, check_init_vocab, compiled_eval_step, compiled_step,
                                     init_fn, mesh_key, optimizer_items, with_params)


class NonFiniteLossError(RuntimeError):
    """The loss (or the gradient norm) became NaN or infinite; training stopped."""


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    config: ModelConfig
    tokenizer: Any
    records: list  # the metrics.jsonl lines written by this call
    run_dir: Path
    timing: dict = dataclasses.field(default_factory=dict)  # report.StepClock.summary()


def train(settings: TrainSettings, out_dir, *, resume: bool = False, progress: bool = True,
          devices=None, grad_fn: GradFn | None = None, log=None,
          allow_data_change: bool = False, check_memory: bool = True,
          init_params=None) -> TrainResult:
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
    check_memory: compile the step first and refuse (MemoryCheckError, before any
    state exists) a step whose memory plan exceeds the device's free memory
    (memory_check); False tries anyway.
    log: a function given human-readable lines (settings, data, compile time, the
    summary; report.py); None: silent.
    init_params: params to start from instead of the seed's (a fine-tune, e.g. of an
    imported Hugging Face model); their vocabulary must be the tokenizer's.

    SIGINT or SIGTERM (stopping.py): the step in flight finishes, the step reached is
    checkpointed (unless it was already), the records are flushed, and Interrupted is
    raised; a second Ctrl-C raises KeyboardInterrupt at once.

    Raises ValueError for bad settings, data or mesh, CheckpointError for a missing,
    bad or mismatched checkpoint (CheckpointWriteError for a failed save),
    NonFiniteLossError when the loss stops being finite.
    """
    settings.validate()
    run_dir = Path(out_dir)

    # the data, the state and the step
    saved_meta = None
    if resume:
        settings, saved_meta = resume_settings(run_dir, settings)
    else:
        check_fresh(run_dir)
    mesh = make_mesh(devices, settings.mesh)
    check_batch_size(settings.batch_size, mesh)
    data = run_data(settings, run_dir, saved_meta, allow_data_change, log)
    config = settings.model_config(data.tokenizer.vocab_size)
    if init_params is not None and not resume:
        check_init_vocab(init_params, config)  # before the step is compiled
    opt_items, on_mesh = optimizer_items(settings), mesh_key(mesh)
    checked = None
    if check_memory:  # the step compiled, and its memory plan checked, before any state exists
        checked = check_run_memory(config, settings, grad_fn or settings.grads, opt_items, on_mesh,
                                   data.batcher.batch(0), mesh.devices.flat[0], log)
    state = init_fn(config, settings.dtype, opt_items, *on_mesh)(settings.seed)
    if resume:
        state = restore_newest(run_dir, state)
    elif init_params is not None:
        state = with_params(state, init_params, config)
    jitted = compiled_step(config, grad_fn or settings.grads, opt_items, settings.dtype, *on_mesh)
    step_fn = checked or jitted
    eval_fn = compiled_eval_step(config, *on_mesh)
    # a corpus with fewer than B validation windows gives one short batch: replicated
    val_batches = [put_batch(b, mesh, replicate_short=True) for b in data.val_batches]
    if log:
        _log_settings(log, settings, config, state.params, mesh)

    main = jax.process_index() == 0  # only the first process writes the run's records
    start = int(jax.device_get(state.step))
    index = int(jax.device_get(state.data_index))
    run_log = RunLog(run_dir, settings, config, mesh.devices.size, start, resumed=resume, main=main,
                     progress=progress, log=log)
    if main:
        write_config(run_dir / CONFIG_FILE, settings, config)
    meta = checkpoint_meta(config, data.tokenizer, settings, data.fingerprint)
    last_saved = start if resume else None

    def stop(s: int, what: str) -> NonFiniteLossError:
        """The error for step s, naming the layer that made the first non-finite value."""
        saver.wait()  # the newest checkpoint complete before it is read back
        kept = (f"the newest healthy checkpoint is step {last_saved} in "
                f"{checkpoint.checkpoint_dir(run_dir)}" if last_saved is not None
                else "no checkpoint was written")
        cause = diagnose_failure(run_dir, last_saved, config, settings, jitted, data.batcher, s,
                                 on_mesh, opt_items)
        return NonFiniteLossError(f"{what}; training stopped, {kept}. {cause}")

    def fetch() -> dict:
        """The metrics since the last fetch on the host; the first non-finite one stops
        the run. Returns the latest step's."""
        fetched = run_log.fetch()
        bad = first_non_finite_loss(fetched)
        if bad is not None:
            s, m = bad
            raise stop(s, f"non-finite loss at step {s} (loss {m['loss']}, gradient norm "
                          f"{m['grad_norm']})")
        return fetched[-1][1]

    # the loop; host batches are made two ahead on a thread, each process reading
    # only the rows it places
    saver = checkpoint.Saver(run_dir, keep=settings.keep_checkpoints)

    def save(s: int) -> None:
        """Start the asynchronous save of step s (never of a state past a non-finite loss)."""
        if run_log.pending:
            fetch()
        with run_log.paused():  # tokens/s counts training time only
            try:
                saver.save(state, meta)
            except checkpoint.UnhealthyStateError as e:
                raise stop(s, str(e)) from None

    aborted = False  # a second Ctrl-C: the save in flight is left unfinished (never damaging)
    rows = local_rows(settings.batch_size, mesh)
    batches = Prefetcher(lambda i: data.batcher.batch(i, rows), index, depth=2)
    try:
        with StopRequests() as stops:
            for s in range(start + 1, settings.steps + 1):  # s: the step count after this step
                batch = put_batch(batches.next(), mesh)
                state, metrics = step_fn(state, batch)  # dispatched; nothing waits for it here
                run_log.add(s, metrics)
                index += 1
                last = s == settings.steps
                do_eval = bool(val_batches) and (last or _every(s, settings.eval_every))
                if do_eval or last or s == start + 1 or s % settings.log_every == 0:
                    record = run_log.record(s, fetch())
                    if do_eval:
                        with run_log.paused():
                            record["val_loss"] = evaluate(eval_fn, state.params, val_batches)
                        record.update(report.val_bits(record["val_loss"], data.tokenizer.kind))
                    run_log.write(record)
                run_log.step_done()
                if last or _every(s, settings.ckpt_every):
                    save(s)
                    last_saved = s
                if stops.requested(s):  # a signal: checkpoint the step reached, then stop
                    saved_now = last_saved != s
                    if saved_now:
                        save(s)
                    saver.close()
                    raise Interrupted(stops.signum, s, checkpoint.checkpoint_dir(run_dir) / str(s),
                                      saved_now)
            if run_log.pending:
                fetch()
    except KeyboardInterrupt:
        aborted = True
        raise
    finally:
        batches.close()
        run_log.close()
        if not aborted:
            saver.close()

    # the report
    timing = run_log.summary()
    return TrainResult(state, config, data.tokenizer, run_log.records, run_dir, timing)


def _every(s: int, n: int) -> bool:
    """Step s is one of every n (n = 0: never)."""
    return bool(n) and s % n == 0


def evaluate(eval_fn, params, batches: list) -> float:
    """The mean loss of ``eval_fn(params, batch)`` over the (device) ``batches``."""
    losses = [eval_fn(params, b) for b in batches]
    return float(np.mean(jax.device_get(losses)))


def _log_settings(log, settings: TrainSettings, config: ModelConfig, params, mesh) -> None:
    devices = f"{mesh.devices.size} {mesh.devices.flat[0].platform} device(s), mesh {dict(mesh.shape)}"
    for line in report.settings_block(settings, config, count_params(params), devices,
                                      recipe_notes(settings)):
        log(line)
