"""Training: the state, one jitted step for any gradient source, and the loop.

A gradient source is any function ``(params, batch) -> (loss, grads)``:
``grad_source("auto", config)`` wraps ``jax.value_and_grad(loss_fn)``,
``grad_source("manual", config)`` the hand-derived ``manual_grads.value_and_grad``.
``make_train_step(grad_fn, optimizer)`` turns either into the same jitted step

    state, metrics = step(state, batch)   # metrics: loss, grad_norm, update_norm, lr

and ``train(settings, out_dir)`` runs the whole loop: data, periodic validation,
``metrics.jsonl``, checkpoints, ``--resume``, a loss-curve PNG at the end.

Data parallelism comes from JAX's own sharding: the batch is split along its
first axis over a one-axis ``Mesh`` of all visible devices, params and optimizer
state are replicated, and jit inserts the gradient all-reduce. One device is the
same code with a mesh of one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxformer import checkpoint
from jaxformer.config import PRESET_TRAINING, PRESETS, ModelConfig, get_preset
from jaxformer.model import loss_fn
from jaxformer.optim import current_lr, make_optimizer
from jaxformer.params import init_params

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
GRAD_SOURCES = ("auto", "manual")
DTYPES = ("float32", "float64")


class NonFiniteLossError(RuntimeError):
    """The loss (or the gradient norm) became NaN or infinite; training stopped."""


# ----------------------------------------------------------------------------
# state and step


class TrainState(NamedTuple):
    step: jax.Array  # () int32: optimizer calls made so far (micro-steps with accumulation)
    params: Any  # the params pytree of DESIGN.md
    opt_state: Any  # the optimizer's state
    data_index: jax.Array  # () int32: index of the next training batch (Batcher.batch)
    rng: jax.Array  # (2,) uint32 key of the run (a stochastic layer at step s: fold_in(rng, s))


def init_state(params, optimizer: optax.GradientTransformation, seed: int = 0) -> TrainState:
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        data_index=jnp.zeros((), jnp.int32),
        rng=jax.random.PRNGKey(seed),
    )


GradFn = Callable[[Any, dict], tuple[jax.Array, Any]]


def grad_source(kind: str, config: ModelConfig) -> GradFn:
    """The gradient source ``(params, batch) -> (loss, grads)`` named ``kind``:
    "auto" (``jax.value_and_grad`` of the loss) or "manual" (``manual_grads``)."""
    if kind == "auto":
        value_and_grad = jax.value_and_grad(loss_fn)
        return lambda params, batch: value_and_grad(params, batch, config)
    if kind == "manual":
        import manual_grads  # here: manual_grads imports jaxformer

        return lambda params, batch: manual_grads.value_and_grad(params, batch, config)
    raise ValueError(f"unknown gradient source {kind!r}; choose one of {', '.join(GRAD_SOURCES)}")


def make_train_step(grad_fn: GradFn, optimizer: optax.GradientTransformation, *,
                    mesh: Mesh | None = None, donate: bool = True):
    """One jitted training step ``(state, batch) -> (state, metrics)`` for any gradient
    source. The input state's buffers are donated (do not reuse it after the call).

    With a ``mesh`` (one axis, "data"), the batch is split along its first axis over
    the mesh and the state replicated: jit runs data parallel.
    metrics: loss, grad_norm (global norm of the gradient), update_norm, lr.
    """

    def step(state: TrainState, batch):
        loss, grads = grad_fn(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = TrainState(state.step + 1, params, opt_state, state.data_index + 1, state.rng)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "update_norm": optax.tree.norm(updates),
            "lr": current_lr(opt_state),
        }
        return new_state, metrics

    kwargs = {"donate_argnums": (0,)} if donate else {}
    if mesh is not None:
        replicated, split = mesh_shardings(mesh)
        kwargs.update(in_shardings=(replicated, split), out_shardings=replicated)
    return jax.jit(step, **kwargs)


def make_eval_step(config: ModelConfig, mesh: Mesh | None = None):
    """Jitted ``(params, batch) -> loss``."""
    kwargs = {}
    if mesh is not None:
        replicated, _ = mesh_shardings(mesh)
        kwargs.update(out_shardings=replicated)
    return jax.jit(lambda params, batch: loss_fn(params, batch, config), **kwargs)


def make_mesh(devices=None) -> Mesh:
    """A one-axis ("data") mesh over ``devices`` (default: all visible devices)."""
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.array(devices), ("data",))


def mesh_shardings(mesh: Mesh) -> tuple[NamedSharding, NamedSharding]:
    """(replicated, split along the first axis) shardings on ``mesh``."""
    return NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))


def put_batch(batch: dict, mesh: Mesh) -> dict:
    """The batch on the mesh: split along the batch axis when it divides evenly over the
    devices, replicated otherwise (a short evaluation batch)."""
    replicated, split = mesh_shardings(mesh)
    n = mesh.devices.size
    return {k: jax.device_put(v, split if np.shape(v)[0] % n == 0 else replicated)
            for k, v in batch.items()}


# ----------------------------------------------------------------------------
# settings


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Everything a run needs besides its folder. ``settings_for(preset, **flags)``
    fills it from the preset's recipe (config.PRESET_TRAINING)."""

    preset: str = "tiny"  # model shape: a key of config.PRESETS
    grads: str = "auto"  # gradient source: auto (jax.grad) | manual (manual_grads)
    steps: int = 100  # total optimizer calls of the run (the schedule's horizon)
    corpus: str = "default"  # "default", "stdlib" or a file/folder path
    tokenizer: str = "byte"  # byte | char
    max_corpus_bytes: int | None = None  # read at most this much of the corpus
    val_fraction: float = 0.1  # the last part of the corpus, held out for validation
    optimizer: str = "adam"  # sgd | momentum | adam | adamw
    lr: float = 1e-3  # peak learning rate
    schedule: str = "constant"  # constant | cosine | linear (after warmup_steps)
    warmup_steps: int = 0
    clip_value: float | None = None  # clip each gradient entry to [-v, v]
    clip_norm: float | None = None  # clip the gradient's global norm
    weight_decay: float = 0.0
    momentum: float = 0.9  # for the momentum optimizer
    accum_steps: int = 1  # micro-batches averaged into one update
    batch_size: int = 16  # B, sequences per step (divisible by the device count)
    seq_len: int = 64  # T, tokens per sequence (<= the model's max_seq_len)
    seed: int = 0  # params init, batch order
    dtype: str = "float32"  # params dtype: float32 | float64 (needs jax_enable_x64)
    eval_every: int = 50  # validation every N steps (and at the end); 0: only at the end
    eval_batches: int = 8  # validation batches per evaluation
    log_every: int = 10  # a metrics.jsonl line every N steps (and at the first and last)
    ckpt_every: int = 100  # checkpoint every N steps (and at the end); 0: only at the end
    keep_checkpoints: int = 3  # how many of the latest checkpoints stay on disk

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainSettings":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def replace(self, **changes) -> "TrainSettings":
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        if self.grads not in GRAD_SOURCES:
            raise ValueError(f"unknown gradient source {self.grads!r}; choose one of {', '.join(GRAD_SOURCES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        for name in ("steps", "batch_size", "seq_len", "accum_steps", "eval_batches",
                     "log_every", "keep_checkpoints"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("eval_every", "ckpt_every", "seed", "warmup_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.dtype == "float64" and not jax.config.jax_enable_x64:
            raise ValueError("dtype float64 needs jax_enable_x64 (jax.config.update('jax_enable_x64', True))")
        max_len = PRESETS[self.preset].max_seq_len
        if self.seq_len > max_len:
            raise ValueError(f"seq_len {self.seq_len} exceeds the {self.preset} model's max_seq_len {max_len}")
        # the optimizer validates its own arguments
        make_optimizer(**self.optimizer_kwargs())

    def optimizer_kwargs(self) -> dict[str, Any]:
        updates = -(-self.steps // self.accum_steps)  # the schedule counts optimizer updates
        if self.schedule == "constant":
            updates = None  # no horizon: runs of any length share one compiled step
        return dict(
            name=self.optimizer, lr=self.lr, schedule=self.schedule,
            warmup_steps=self.warmup_steps, total_steps=updates, clip_value=self.clip_value,
            clip_norm=self.clip_norm, weight_decay=self.weight_decay, momentum=self.momentum,
            accum_steps=self.accum_steps,
        )


# Settings a resumed run may change; any other difference from the checkpoint is an error.
RESUMABLE_CHANGES = frozenset(
    {"steps", "grads", "eval_every", "eval_batches", "log_every", "ckpt_every", "keep_checkpoints"}
)


def settings_for(preset: str, **flags) -> TrainSettings:
    """TrainSettings of ``preset``: its PRESET_TRAINING recipe, then ``flags`` (None
    values are ignored, so unset command-line options fall through)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    names = {f.name for f in dataclasses.fields(TrainSettings)}
    unknown = sorted(set(flags) - names)
    if unknown:
        raise ValueError(f"unknown train setting(s): {', '.join(unknown)}")
    values = dict(PRESET_TRAINING.get(preset, {}))
    values.update({k: v for k, v in flags.items() if v is not None})
    values["preset"] = preset
    return TrainSettings(**values)


def diff_fields(saved: dict, requested: dict, ignore=()) -> list[str]:
    """'name: saved -> requested' for each field whose value differs."""
    out = []
    for name in sorted(set(saved) | set(requested)):
        if name in ignore:
            continue
        a, b = saved.get(name), requested.get(name)
        if a != b:
            out.append(f"{name}: {a!r} (checkpoint) vs {b!r} (requested)")
    return out


# ----------------------------------------------------------------------------
# the loop


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    config: ModelConfig
    tokenizer: Any
    records: list  # the metrics.jsonl lines written by this call
    run_dir: Path


def _write_record(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_metrics(run_dir) -> list[dict]:
    """The records of ``<run_dir>/metrics.jsonl``."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines logged after ``last_step`` (written after the checkpoint a run resumes)."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line).get("step", 0) <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


def plot_losses(records: list[dict], path) -> None:
    """A PNG of the training loss (and validation loss where evaluated) against step."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", ms=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


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
    return TrainResult(state, config, tokenizer, records, run_dir)


# Runs in one process with the same model, optimizer and devices share one compiled
# step (a resumed run, a test suite): jit caches per function object.


@functools.lru_cache(maxsize=8)
def _optimizer(opt_items: tuple) -> optax.GradientTransformation:
    return make_optimizer(**dict(opt_items))


@functools.lru_cache(maxsize=8)
def _init_fn(config: ModelConfig, dtype: str, opt_items: tuple, devices: tuple):
    """Jitted seed -> the initial TrainState, replicated over the devices (one compile
    instead of one per random draw)."""
    replicated, _ = mesh_shardings(make_mesh(devices))

    def init(seed):
        params = init_params(jax.random.PRNGKey(seed), config, dtype=jnp.dtype(dtype))
        return init_state(params, _optimizer(opt_items), seed)

    return jax.jit(init, out_shardings=replicated)


@functools.lru_cache(maxsize=8)
def _step(config: ModelConfig, grads: str, opt_items: tuple, devices: tuple):
    return make_train_step(grad_source(grads, config), _optimizer(opt_items), mesh=make_mesh(devices))


@functools.lru_cache(maxsize=8)
def _custom_step(grad_fn: GradFn, opt_items: tuple, devices: tuple):
    return make_train_step(grad_fn, _optimizer(opt_items), mesh=make_mesh(devices))


@functools.lru_cache(maxsize=8)
def _eval_step(config: ModelConfig, devices: tuple):
    return make_eval_step(config, make_mesh(devices))


def _progress_bar(start: int, total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, disable=not enabled, unit="step", dynamic_ncols=True)
