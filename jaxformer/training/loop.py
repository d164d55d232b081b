"""Training: the loop. ``train(settings, out_dir)`` runs a whole run: data,
periodic validation, ``metrics.jsonl``, checkpoints, ``--resume``, a loss-curve PNG
at the end. It reads top to bottom: ``prepare_run`` builds the mesh, the data, the
compiled steps and the starting state (no file written); ``run_steps`` opens the run's
writers (metrics.jsonl, TensorBoard, checkpoints), steps, and closes them on every way
out; ``train`` reports.

The pieces live beside it: ``settings`` (TrainSettings and the preset recipes),
``run_data`` (corpus, tokenizer, batches), ``resume`` (what a resumed run may
change, and the checks), ``step`` (TrainState, gradient sources, the jitted step),
``sharding`` (the mesh), and ``observe.run_log`` (the run's records, bar and plots).

Parallelism comes from JAX's own sharding: a ("data", "fsdp") ``Mesh`` of all
devices (``settings.mesh``, default every device on "data"); the batch is split
over data x fsdp, params and optimizer state over fsdp (sharding.py), and jit
inserts the collectives. One device is the same code with a mesh of one; several
processes (``jax.distributed``) are one job over all their devices.

The loop keeps at most two steps in flight: after dispatching step s it waits until
step s - 1 is done (its results ready, nothing copied), so the device always has the next
step queued while the progress bar counts finished steps and a stop signal is honoured
after the step in flight. The step's metrics stay on the device until a log line, an
evaluation or a checkpoint needs them; then all metrics since the last fetch come back at
once and the first non-finite loss among them stops the run, naming its step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jaxformer.checkpoints import checkpoint
from jaxformer.data import Prefetcher
from jaxformer.model.config import ModelConfig
from jaxformer.model.params import count_params, validate_params
from jaxformer.model.quantized import as_dtype
from jaxformer.observe import report
from jaxformer.observe.run_log import RunLog, close_all, first_non_finite_loss
from jaxformer.training import samples
from jaxformer.training.adapters import base_digest, frozen_base, lora_eval_fn
from jaxformer.training.configfile import CONFIG_FILE, write_config
from jaxformer.training.diagnose import diagnose_failure
from jaxformer.training.memory_check import check_run_memory
from jaxformer.training.resume import check_fresh, checkpoint_meta, restore_newest, resume_settings
from jaxformer.training.run_data import RunData, run_data
from jaxformer.training.settings import TrainSettings, grads_text, recipe_notes
from jaxformer.model.parallel.context import check_context_model
from jaxformer.model.parallel.tensor import check_tensor
from jaxformer.training.sharding import check_batch_size, describe, local_rows, make_mesh, put_batch
from jaxformer.training.stopping import Interrupted, StopRequests
from jaxformer.training.step import (GradFn, StepSpec, TrainState, check_init_vocab, compiled_eval_step,
                                     compiled_step, init_fn, with_params)


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

    SIGINT or SIGTERM (stopping.py): a line on stderr says at once that it was heard; the
    step in flight finishes, the step reached is checkpointed (unless it was already), the
    records are flushed, and Interrupted is raised; a second Ctrl-C raises KeyboardInterrupt
    as soon as the main thread runs again.

    Raises ValueError for bad settings, data or mesh, CheckpointError for a missing,
    bad or mismatched checkpoint (CheckpointWriteError for a failed save),
    NonFiniteLossError when the loss stops being finite.
    """
    settings.validate()
    run = prepare_run(settings, Path(out_dir), resume=resume, devices=devices, grad_fn=grad_fn, log=log,
                      allow_data_change=allow_data_change, check_memory=check_memory,
                      init_params=init_params)
    if log:
        _log_settings(log, run.settings, run.config, run.state.params, run.mesh, run.spec.grads,
                      from_preset=init_params is None)
    state, run_log = run_steps(run, progress=progress, log=log)
    return TrainResult(state, run.config, run.data.tokenizer, run_log.records, run.run_dir,
                       run_log.summary())


@dataclasses.dataclass
class PreparedRun:
    """A run ready to step: what ``prepare_run`` makes before the first step and the first file."""
    settings: TrainSettings  # a resumed run's: its schedule horizon kept (resume.resume_settings)
    run_dir: Path
    resumed: bool
    mesh: Mesh
    data: RunData
    spec: StepSpec  # the compiled step's identity: config, gradient source, optimizer, dtype, mesh
    state: TrainState  # the state the steps start from
    step_fn: Callable  # the step the loop calls: the memory check's executable, else ``jitted``
    jitted: Callable  # the jitted step (a non-finite step's diagnosis replays with it)
    eval_fn: Callable  # jitted (params, batch) -> loss
    val_batches: list  # the validation batches, on the mesh

    @property
    def config(self) -> ModelConfig:
        return self.spec.config


def prepare_run(settings: TrainSettings, run_dir: Path, *, resume: bool = False, devices=None,
                grad_fn: GradFn | None = None, log=None, allow_data_change: bool = False,
                check_memory: bool = True, init_params=None) -> PreparedRun:
    """The mesh, the data, the compiled steps and the starting state of a run (the
    arguments are train's); writes no file."""
    saved_meta = None
    if resume:
        settings, saved_meta = resume_settings(run_dir, settings)
    else:
        check_fresh(run_dir)
    mesh = make_mesh(devices, settings.mesh)
    check_batch_size(settings.batch_size, mesh)
    data = run_data(settings, run_dir, saved_meta, allow_data_change, log)
    config = settings.model_config(data.tokenizer.vocab_size)
    sizes = dict(mesh.shape)  # before the step is compiled: one line each
    check_tensor(config, sizes.get("tensor", 1), settings.seq_len if config.sequence_parallel else None)
    check_context_model(config, sizes.get("context", 1), settings.seq_len, sizes.get("tensor", 1))
    if init_params is not None and (settings.lora_rank or not resume):
        check_init_vocab(init_params, config)  # before the step is compiled
    base = None
    if settings.lora_rank:  # the frozen base, and the gradient source over the adapters
        settings, base = lora_start(settings, config, init_params, saved_meta)
    spec = StepSpec.of_run(settings, config, mesh, grad_fn, base)
    jitted = step_fn = compiled_step(spec)
    if check_memory:  # the step compiled, and its memory plan checked, before any state exists
        step_fn = check_run_memory(spec, settings, data.batcher.batch(0), mesh.devices.flat[0], log)
    state = init_fn(spec)(settings.seed)
    if resume:
        state = restore_newest(run_dir, state)
    elif init_params is not None and base is None:
        state = with_params(state, init_params, spec.config)
    # a corpus with fewer than B validation windows gives one short batch: replicated
    val_batches = [put_batch(b, mesh, replicate_short=True) for b in data.val_batches]
    eval_fn = compiled_eval_step(spec) if base is None else lora_eval_fn(spec.config, spec.lora, base)
    return PreparedRun(settings, run_dir, resume, mesh, data, spec, state, step_fn, jitted, eval_fn,
                       val_batches)


def lora_start(settings: TrainSettings, config: ModelConfig, init_params, saved_meta):
    """(settings with the base's digest, the frozen base on the devices) of a LoRA run;
    CheckpointError when a resumed run's base is another."""
    if init_params is None:  # lora_base read again, or the seed's init
        init_params = frozen_base(settings, config)
    base = jax.device_put(as_dtype(init_params, settings.dtype))  # a Quantized base keeps its codes
    validate_params(base, config)
    digest = base_digest(base)
    saved = (saved_meta or {}).get("settings", {}).get("lora_base_digest")
    if saved and saved != digest:
        raise checkpoint.CheckpointError(
            f"the frozen model ({settings.lora_base or 'the seed init'}) is not the one the "
            f"adapters were trained on (sha256 {digest[:12]} now, {saved[:12]} recorded)")
    settings = settings.replace(lora_base_digest=digest)
    return settings, base


def run_steps(run: PreparedRun, *, progress: bool = True, log=None) -> tuple[TrainState, RunLog]:
    """Step ``run`` from its state to ``settings.steps``; returns the last state and the
    RunLog of the call (its records and clock). Host batches are made two ahead on a
    thread, each process reading only the rows it places. The writers (metrics.jsonl
    and TensorBoard: RunLog; checkpoints: Saver) and the batch thread are closed on
    every way out; when the run fails, a writer's own failure to close (the same full
    disk) is dropped, so the run's error is the one reported."""
    main = jax.process_index() == 0  # only the first process writes the run's records
    start = int(jax.device_get(run.state.step))
    saver = checkpoint.Saver(run.run_dir, keep=run.settings.keep_checkpoints)
    rows = local_rows(run.settings.batch_size, run.mesh)
    batches = Prefetcher(lambda i: run.data.batcher.batch(i, rows), int(jax.device_get(run.state.data_index)),
                         depth=2)
    closers = {"batches": batches.close}
    try:
        run_log = RunLog(run.run_dir, run.settings, run.config, run.mesh.devices.size, start,
                         resumed=run.resumed, main=main, progress=progress, log=log)
        closers.update(records=run_log.close, checkpoints=saver.close)
        if main:
            write_config(run.run_dir / CONFIG_FILE, run.settings, run.config)
        with StopRequests() as stops:
            state = _Steps(run, start, run_log, saver).loop(run.state, stops, batches)
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):  # a second Ctrl-C: the save in flight is left
            closers.pop("checkpoints", None)  # unfinished (never damaging)
        close_all(closers.values())
        raise
    error = close_all(closers.values())
    if error is not None:
        raise error
    return state, run_log


class _Steps:
    """The steps of a prepared run from step ``start``, writing through ``run_log`` and
    ``saver``; the newest checkpoint written or resumed from is ``last_saved``."""

    def __init__(self, run: PreparedRun, start: int, run_log: RunLog, saver: checkpoint.Saver):
        self.run, self.start, self.run_log, self.saver = run, start, run_log, saver
        self.last_saved = start if run.resumed else None
        self.meta = checkpoint_meta(run.config, run.data.tokenizer, run.settings, run.data.fingerprint)

    def loop(self, state: TrainState, stops: StopRequests, batches: Prefetcher) -> TrainState:
        """The steps from ``state`` on; returns the last state."""
        settings = self.run.settings
        for s in range(self.start + 1, settings.steps + 1):  # s: the step count after this step
            batch = put_batch(batches.next(), self.run.mesh)
            state, metrics = self.run.step_fn(state, batch)  # dispatched; nothing waits for it here
            self.run_log.add(s, metrics)
            # step s - 1 finished before step s + 1 is dispatched: the device always has the next
            # step queued, and the bar and a stop signal are never more than one step behind
            self.run_log.finished(s - 1)
            last = s == settings.steps
            self.report(state, s, last)
            if last or _every(s, settings.ckpt_every):
                self.save(state, s)
            if stops.requested(s):  # a signal: checkpoint the step reached, then stop
                saved_now = self.last_saved != s
                if saved_now:
                    self.save(state, s)
                self.saver.close()
                raise Interrupted(stops.signum, s, checkpoint.checkpoint_dir(self.run.run_dir) / str(s),
                                  saved_now)
        if self.run_log.pending:
            self.fetch()
        return state

    def report(self, state: TrainState, s: int, last: bool) -> None:
        """The record of step s, when s is logged (with the validation loss when evaluated)."""
        settings = self.run.settings
        do_eval = bool(self.run.val_batches) and (last or _every(s, settings.eval_every))
        if not (do_eval or last or s == self.start + 1 or s % settings.log_every == 0):
            return
        record = self.run_log.record(s, self.fetch())
        if do_eval:
            with self.run_log.paused():
                record["val_loss"] = evaluate(self.run.eval_fn, state.params, self.run.val_batches)
                record.update(samples.at_eval(self.run, state.params, s, record["val_loss"], self.run_log.log))
            record.update(report.val_bits(record["val_loss"], self.run.data.tokenizer.kind))
        self.run_log.write(record)

    def fetch(self) -> dict:
        """The metrics since the last fetch on the host; the first non-finite one stops
        the run. Returns the latest step's."""
        fetched = self.run_log.fetch()
        bad = first_non_finite_loss(fetched)
        if bad is not None:
            s, m = bad
            raise self.stop(s, f"non-finite loss at step {s} (loss {m['loss']}, gradient norm "
                               f"{m['grad_norm']})")
        return fetched[-1][1]

    def save(self, state: TrainState, s: int) -> None:
        """Start the asynchronous save of step s (never of a state past a non-finite loss)."""
        if self.run_log.pending:
            self.fetch()
        with self.run_log.paused():  # tokens/s counts training time only
            try:
                self.saver.save(state, self.meta)
            except checkpoint.UnhealthyStateError as e:
                raise self.stop(s, str(e)) from None
        self.last_saved = s

    def stop(self, s: int, what: str) -> NonFiniteLossError:
        """The error for step s, naming the layer that made the first non-finite value."""
        self.saver.wait()  # the newest checkpoint complete before it is read back
        run = self.run
        kept = (f"the newest healthy checkpoint is step {self.last_saved} in "
                f"{checkpoint.checkpoint_dir(run.run_dir)}" if self.last_saved is not None
                else "no checkpoint was written")
        cause = diagnose_failure(run.run_dir, self.last_saved, run.spec, run.settings, run.jitted,
                                 run.data.batcher, s)
        return NonFiniteLossError(f"{what}; training stopped, {kept}. {cause}")


def _every(s: int, n: int) -> bool:
    """Step s is one of every n (n = 0: never)."""
    return bool(n) and s % n == 0


def evaluate(eval_fn, params, batches: list) -> float:
    """The mean loss of ``eval_fn(params, batch)`` over the (device) ``batches``."""
    losses = [eval_fn(params, b) for b in batches]
    return float(np.mean(jax.device_get(losses)))


def _log_settings(log, settings: TrainSettings, config: ModelConfig, params, mesh, grads,
                  from_preset: bool = True) -> None:
    """The settings block: every field, and the preset recipe's notes, for a run from a preset;
    a run from given params (a fine-tune, its recipe's values printed with their sources by the
    command) gets the short block, and no note about a preset's recipe it did not use."""
    devices = f"{mesh.devices.size} {mesh.devices.flat[0].platform} device(s), mesh {describe(mesh)}"
    notes = recipe_notes(settings) if from_preset else []
    for line in report.settings_block(settings, config, count_params(params), devices,
                                      grads_text(grads, config), notes, fields=from_preset):
        log(line)
