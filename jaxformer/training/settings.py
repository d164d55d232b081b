"""TrainSettings: everything a training run needs besides its folder, and the
preset recipes that fill it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from jaxformer.model.config import PRESET_TRAINING, PRESETS, ModelConfig, get_preset
from jaxformer.model.validate import check_precision
from jaxformer.observe.words import plural
from jaxformer.training.optim import make_optimizer
from jaxformer.training.sharding import parse_mesh

GRAD_SOURCES = ("auto", "manual")
# numeric settings that must be finite (the optimizer and the data split check their ranges)
FLOAT_FIELDS = ("lr", "clip_value", "clip_norm", "weight_decay", "momentum", "val_fraction",
                "beta1", "beta2", "adam_eps", "min_lr", "muon_lr", "muon_momentum")
DTYPES = ("float32", "float64")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Everything a run needs besides its folder. ``settings_for(preset, **flags)``
    fills it from the preset's recipe (config.PRESET_TRAINING)."""

    preset: str = "tiny"  # model shape: a key of config.PRESETS
    model: dict = dataclasses.field(default_factory=dict)  # ModelConfig fields overriding the preset's
    grads: str = "auto"  # gradient source: auto (jax.grad) | manual (manual_grads)
    steps: int = 100  # total optimizer calls of the run
    schedule_steps: int | None = None  # the schedule's horizon (None: steps); kept on resume
    corpus: str = "default"  # "default", "stdlib" or a file/folder path
    tokenizer: str = "byte"  # byte | char | bpe | gpt2 | a tokenizer.json path
    vocab_size: int | None = None  # the vocabulary a bpe tokenizer learns (--tokenizer bpe)
    data: str | None = None  # a prepared data folder (jaxformer prepare); replaces corpus/tokenizer
    max_corpus_bytes: int | None = None  # read at most this much of the corpus
    val_fraction: float = 0.1  # the last part of the corpus, held out for validation
    optimizer: str = "adam"  # sgd | momentum | adam | adamw | muon (Muon for matrices, AdamW for the rest)
    lr: float = 1e-3  # peak learning rate
    schedule: str = "constant"  # constant | cosine | linear (after warmup_steps)
    warmup_steps: int = 0
    clip_value: float | None = None  # clip each gradient entry to [-v, v]
    clip_norm: float | None = None  # clip the gradient's global norm
    weight_decay: float = 0.0
    momentum: float = 0.9  # for the momentum optimizer
    beta1: float = 0.9  # Adam's first-moment decay
    beta2: float = 0.999  # Adam's second-moment decay (nanoGPT: 0.95, 0.99 for small runs)
    adam_eps: float = 1e-8  # Adam's epsilon
    min_lr: float | None = None  # floor of a decaying schedule (None: a tenth of lr)
    decay_rule: str = "nanogpt"  # which leaves weight decay applies to: nanogpt | no-embed | all
    muon_lr: float = 0.02  # optimizer muon: peak rate of the hidden weight matrices (lr: the rest's)
    muon_momentum: float = 0.95  # optimizer muon: Muon's Nesterov momentum (modded-nanogpt's)
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
    mesh: str = ""  # device mesh "data=N,fsdp=M" (sharding.parse_mesh); "": all devices on data

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainSettings":
        """The settings of ``d``; a key that names no field is refused by name."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown train settings key(s): {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(names))}")
        return cls(**d)

    def replace(self, **changes) -> "TrainSettings":
        return dataclasses.replace(self, **changes)

    def model_config(self, vocab_size: int | None = None) -> ModelConfig:
        """The preset's ModelConfig with ``model``'s overrides (and the tokenizer's
        ``vocab_size``); a bad field raises ModelConfig's named ValueError."""
        if not isinstance(self.model, dict):
            raise ValueError(f"model must be a dict of ModelConfig fields, got {self.model!r}")
        overrides = dict(self.model)
        if vocab_size is not None:
            overrides["vocab_size"] = vocab_size
        names = {f.name for f in dataclasses.fields(ModelConfig)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s): {', '.join(unknown)}")
        return get_preset(self.preset, **overrides)

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
        if self.schedule_steps is not None and (
                isinstance(self.schedule_steps, bool) or not isinstance(self.schedule_steps, int)
                or self.schedule_steps < 1):
            raise ValueError(f"schedule_steps must be a positive integer, got {self.schedule_steps!r}")
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if value is None and name in ("clip_value", "clip_norm", "min_lr"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in ("eval_every", "ckpt_every", "seed", "warmup_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.dtype == "float64" and not jax.config.jax_enable_x64:
            raise ValueError("dtype float64 needs jax_enable_x64 (jax.config.update('jax_enable_x64', True))")
        check_precision({}, self.model_config())  # float16 compute: refused before any data is read
        max_len = self.model_config().max_seq_len
        if self.seq_len > max_len:
            raise ValueError(f"seq_len {self.seq_len} exceeds the {self.preset} model's max_seq_len "
                             f"{max_len}{' (with the model overrides)' if self.model else ''}")
        parse_mesh(self.mesh)  # the syntax; the device count is checked when the mesh is built
        if self.schedule != "constant" and self.warmup_steps >= _updates(self):
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must be smaller than the {_updates(self)} "
                f"optimizer updates of the run for the {self.schedule} schedule; lower "
                f"--warmup-steps, raise --steps or use --schedule constant")
        # the optimizer validates its own arguments
        make_optimizer(**self.optimizer_kwargs())

    def optimizer_kwargs(self) -> dict[str, Any]:
        horizon = self.schedule_steps or self.steps
        updates = -(-horizon // self.accum_steps)  # the schedule counts optimizer updates
        if self.schedule == "constant":
            updates = None  # no horizon: runs of any length share one compiled step
        return dict(
            name=self.optimizer, lr=self.lr, schedule=self.schedule,
            warmup_steps=self.warmup_steps, total_steps=updates, clip_value=self.clip_value,
            clip_norm=self.clip_norm, weight_decay=self.weight_decay, momentum=self.momentum,
            accum_steps=self.accum_steps, b1=self.beta1, b2=self.beta2, eps=self.adam_eps,
            min_lr=self.min_lr, decay_rule=self.decay_rule, muon_lr=self.muon_lr,
            muon_momentum=self.muon_momentum,
        )


# Settings a resumed run may change; any other difference from the checkpoint is an error.
# (The model shape is compared through the resolved ModelConfig: config_diff.)
RESUMABLE_CHANGES = frozenset(
    {"steps", "schedule_steps", "grads", "eval_every", "eval_batches", "log_every", "ckpt_every",
     "keep_checkpoints", "mesh", "data",  # data: the folder may move; its digests are checked
     "lr", "muon_lr", "clip_norm"}  # after a non-finite loss (resume.py notes the change; clipping turned on
)                        # or off is refused: it changes the optimizer state)


def settings_for(preset: str, **flags) -> TrainSettings:
    """TrainSettings of ``preset``: its PRESET_TRAINING recipe, then ``flags`` (None
    values are ignored, so unset command-line options fall through). ``model`` is a
    dict of ModelConfig fields overriding the preset's shape."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    names = {f.name for f in dataclasses.fields(TrainSettings)}
    unknown = sorted(set(flags) - names)
    if unknown:
        raise ValueError(f"unknown train setting(s): {', '.join(unknown)}")
    values = dict(PRESET_TRAINING.get(preset, {}))
    values.update({k: v for k, v in flags.items() if v is not None})
    values["preset"] = preset
    values["model"] = dict(values.get("model") or {})
    if flags.get("warmup_steps") is None:
        values["warmup_steps"] = fit_warmup(TrainSettings(**values))
    return TrainSettings(**values)


def _updates(settings: TrainSettings) -> int:
    """Optimizer updates of a run: the horizon of its schedule."""
    return -(-settings.steps // settings.accum_steps)


def fit_warmup(settings: TrainSettings) -> int:
    """The recipe's warmup, shortened to a tenth of the run's updates when it does not
    fit before a decaying schedule's horizon (a short smoke run of any preset works)."""
    updates = _updates(settings)
    if settings.schedule == "constant" or settings.warmup_steps < updates:
        return settings.warmup_steps
    return updates // 10


def recipe_notes(settings: TrainSettings) -> list[str]:
    """One line per recipe value that ``settings_for`` changed to fit the run."""
    recipe = PRESET_TRAINING.get(settings.preset, {}).get("warmup_steps", 0)
    if settings.warmup_steps < recipe and fit_warmup(settings.replace(warmup_steps=recipe)) \
            == settings.warmup_steps:
        return [f"warmup shortened from the {settings.preset} recipe's {recipe} updates to "
                f"{settings.warmup_steps}, a tenth of this run's {_updates(settings)} "
                f"(--warmup-steps sets it)"]
    return []


def config_diff(saved: dict, requested: ModelConfig) -> list[str]:
    """``diff_fields`` of a checkpoint's model config and ``requested``; fields the
    checkpoint predates take their ModelConfig defaults."""
    defaults = ModelConfig().to_dict()
    defaults.pop("vocab_size")
    return diff_fields({**defaults, **saved}, requested.to_dict())


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


def horizon(settings: TrainSettings) -> int:
    """The step count at which the learning-rate schedule ends."""
    return settings.schedule_steps or settings.steps


def keep_schedule(settings: TrainSettings, saved: TrainSettings) -> tuple[TrainSettings, str | None]:
    """A resumed run keeps the schedule horizon it was started with unless
    ``settings.schedule_steps`` is set: (settings with the saved horizon pinned, a
    one-line note when that differs from the requested steps, else None)."""
    if settings.schedule_steps is not None:
        return settings, None
    kept = horizon(saved)
    if kept == settings.steps:
        return settings, None
    settings = settings.replace(schedule_steps=kept)
    if settings.schedule == "constant":
        return settings, None
    return settings, (f"keeping the {settings.schedule} schedule's horizon at {plural(kept, 'step')} while "
                      f"training to step {settings.steps} (set --schedule-steps to change it)")
