"""TrainSettings: everything a training run needs besides its folder, and the
preset recipes that fill it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxformer.data.packing import parse_mix
from jaxformer.model.checks import check_keys
from jaxformer.model.config import PRESET_TRAINING, PRESETS, ModelConfig, get_preset
from jaxformer.model.lora import LoraConfig, check_targets
from jaxformer.model.validate import check_precision
from jaxformer.observe.words import plural
from jaxformer.training.fields import check_fields, setting
from jaxformer.training.optim import DECAY_RULES, OPTIMIZERS, SCHEDULES, make_optimizer
from jaxformer.training.sharding import parse_mesh
from manual_grads.attention import MANUAL_CORES

GRAD_SOURCES = ("auto", "manual")
PACKINGS = ("windows", "conversations")
DTYPES = ("float32", "float64")
BASE_QUANTS = ("float", "keep", "int8")  # a LoRA run's frozen base held as (model/quantized.py)
# the --help sections of the flags (fields.setting's group)
_DATA, _OPT, _LOG, _DEV = "data", "optimizer", "logging and checkpoints", "devices and processes"
_LORA = "LoRA (adapters on a frozen model)"


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Everything a run needs besides its folder. ``settings_for(preset, **flags)``
    fills it from the preset's recipe (config.PRESET_TRAINING). Each field is declared
    once (fields.setting): its help, range and group give the checks, the ``train``
    flags and their --help, and the [train] table of a config.toml."""

    preset: str = setting("tiny", "model shape and training recipe: a key of config.PRESETS")
    model: dict = setting(None, "ModelConfig fields overriding the preset's", factory=dict)
    grads: str = setting("manual", "gradient source: the hand-derived backward (manual, manual_grads) "
                         "or jax.grad (auto)", group="", choices=GRAD_SOURCES)
    steps: int = setting(100, "total training steps (optimizer calls) of the run", group="", minimum=1,
                         metavar="N")
    corpus: str = setting("default", '"default" (built-in English text), "stdlib" (Python sources) '
                          "or a file/folder path", group=_DATA, metavar="SPEC")
    tokenizer: str = setting("byte", "byte (256 ids), char (the corpus's characters), bpe (a byte-level "
                             "BPE learned from the training text; --vocab-size), gpt2 (GPT-2's, when "
                             "its tokenizer.json is on the machine) or a path to a tokenizer.json",
                             group=_DATA, metavar="KIND")
    vocab_size: int | None = setting(None, "the vocabulary --tokenizer bpe learns", group=_DATA,
                                     minimum=1, metavar="N", unset="the tokenizer's")
    data: str | None = setting(None, "a folder of token shards written by `jaxformer prepare` "
                               "(memory-mapped, never read whole); replaces --corpus and --tokenizer",
                               group=_DATA, metavar="DATA_DIR")
    packed_documents: bool = setting(False, "packed-document attention: each token attends only to "
                                     "its own document (conversation) within a row, from the document "
                                     "starts a chat --data folder carries (batch['segments'])", group=_DATA)
    packing: str = setting("windows", "rows of a batch: windows (T + 1 tokens cut from the token stream) or "
                           "conversations (a chat --data folder's conversations packed whole into rows, "
                           "each row's numbered for attention: batch['segments'])", group=_DATA,
                           choices=PACKINGS)
    epochs: int | None = setting(None, "passes over a --data folder's rows (packed conversations or "
                                 "windows): --steps from its size and --batch-size", group=_DATA, minimum=1,
                                 metavar="N", unset="--steps sets the length")
    mix: str = setting("", "DATA:WEIGHT: a second prepared data folder (the same tokenizer; chats or "
                       "text) whose rows fill a fraction WEIGHT in (0, 1) of each batch, placed by the seed",
                       group=_DATA, metavar="DATA:WEIGHT")
    max_corpus_bytes: int | None = setting(None, "read at most N bytes of the corpus", group=_DATA,
                                           minimum=1, metavar="N", unset="all")
    val_fraction: float = setting(0.1, "held-out tail of the corpus, for validation", group=_DATA,
                                  metavar="F")
    optimizer: str = setting("adam", "muon: Muon for the blocks' weight matrices, AdamW (--lr) for "
                             "embeddings, head, norms and biases", group=_OPT, choices=OPTIMIZERS)
    lr: float = setting(1e-3, "(peak) learning rate", group=_OPT, metavar="LR")
    schedule: str = setting("constant", "learning-rate schedule after the warmup", group=_OPT,
                            choices=SCHEDULES)
    warmup_steps: int = setting(0, "updates of linear warmup", group=_OPT, minimum=0, metavar="N")
    schedule_steps: int | None = setting(None, "the schedule's horizon (a resumed run keeps its own)",
                                         group=_OPT, minimum=1, metavar="N", unset="--steps")
    clip_value: float | None = setting(None, "clip each gradient entry to [-V, V] (0: off)", group=_OPT,
                                       metavar="V", unset="off")
    clip_norm: float | None = setting(None, "clip the gradient's global norm to N (0: off)", group=_OPT,
                                      metavar="N", unset="off")
    weight_decay: float = setting(0.0, "weight decay: decoupled for adamw and muon, added to the "
                                  "gradient otherwise", group=_OPT, metavar="W")
    momentum: float = setting(0.9, "for --optimizer momentum", group=_OPT, metavar="M")
    beta1: float = setting(0.9, "Adam's first-moment decay", group=_OPT, metavar="B")
    beta2: float = setting(0.999, "Adam's second-moment decay (nanoGPT: 0.95, 0.99 for small models)",
                           group=_OPT, metavar="B")
    adam_eps: float = setting(1e-8, "Adam's epsilon", group=_OPT, metavar="E")
    min_lr: float | None = setting(None, "where a cosine/linear schedule ends", group=_OPT,
                                   metavar="LR", unset="a tenth of --lr")
    decay_rule: str = setting("nanogpt", "leaves weight decay applies to: nanogpt (weight matrices and "
                              "embeddings, not biases or norms), no-embed (weight matrices only), all",
                              group=_OPT, choices=DECAY_RULES)
    muon_lr: float = setting(0.02, "--optimizer muon: peak learning rate of the weight matrices "
                             "(--lr: the rest's)", group=_OPT, metavar="LR")
    muon_momentum: float = setting(0.95, "--optimizer muon: Muon's Nesterov momentum", group=_OPT,
                                   metavar="M")
    accum_steps: int = setting(1, "average K micro-batches per update", group=_OPT, minimum=1,
                               metavar="K")
    batch_size: int = setting(16, "sequences per step (divisible by the device count)", group=_DATA,
                              minimum=1, metavar="B")
    seq_len: int = setting(64, "tokens per sequence (<= the model's max_seq_len)", group=_DATA,
                           minimum=1, metavar="T")
    seed: int = setting(0, "seed of the params init and the batch order", group=_DATA, minimum=0,
                        metavar="N")
    dtype: str = setting("float32", "params dtype", group=_OPT,
                         choices=DTYPES)
    eval_every: int = setting(50, "validation loss every N steps and at the end (0: at the end only)",
                              group=_LOG, minimum=0, metavar="N")
    eval_batches: int = setting(8, "validation batches per evaluation", group=_LOG, minimum=1,
                                metavar="N")
    log_every: int = setting(10, "a metrics.jsonl line every N steps (and at the first and last)",
                             group=_LOG, minimum=1, metavar="N")
    ckpt_every: int = setting(100, "checkpoint every N steps and at the end (0: at the end only)",
                              group=_LOG, minimum=0, metavar="N")
    eval_samples: int = setting(0, "at each evaluation, the greedy replies (at most 32 tokens, to the end "
                                "of turn) to N held-out prompts of a chat --data folder's validation "
                                "split, printed beside the loss", group=_LOG, minimum=0, metavar="N")
    keep_checkpoints: int = setting(3, "latest checkpoints kept on disk", group=_LOG, minimum=1,
                                    metavar="N")
    mesh: str = setting("", "device mesh data=N,fsdp=M[,expert=X][,tensor=T]: the batch splits over N*M*X devices, "
                        "params and optimizer state over M, an MoE model's experts over X, each block's matrices "
                        "over T (tensor parallel) (\"\": every device on data)",
                        group=_DEV, metavar="SPEC")

    lora_rank: int = setting(0, "train LoRA adapters of rank R on the frozen model (--init-from's, else "
                             "the seed's); 0: train every parameter", group=_LORA, minimum=0, metavar="R")
    lora_alpha: float = setting(16.0, "the adapters' scale is alpha / rank", group=_LORA, metavar="A")
    lora_dropout: float = setting(0.0, "dropout on the adapters' input", group=_LORA, metavar="P")
    lora_targets: str = setting("q,v", "the projections adapted: q,k,v,o,gate,up,down (the plain MLP's "
                                "in,out) or all", group=_LORA, metavar="LIST")
    base_quant: str = setting("float", "the frozen model's projections held as: float (the run's dtype), keep (a "
                              "GGUF file's Q8_0, Q4_0 or Q4_1 blocks as stored) or int8 (per output column), "
                              "dequantized inside each product", group=_LORA, choices=BASE_QUANTS)
    lora_base: str | None = setting(None, "the frozen model's source (--init-from), read again on resume",
                                    unset="the seed's init")
    lora_base_digest: str = setting("", "sha256 of the frozen model's params, checked on resume")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def lora(self):
        """The run's LoraConfig (model/lora.py), or None when lora_rank is 0."""
        return LoraConfig(self.lora_rank, self.lora_alpha, self.lora_dropout, self.lora_targets) \
            if self.lora_rank else None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainSettings":
        """The settings of ``d``; a key that names no field is refused by name."""
        check_keys("train settings key(s)", d, cls, name_known=True)
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
        check_fields(self)  # each integer >= its minimum, each number finite
        if self.base_quant not in BASE_QUANTS:
            raise ValueError(f"unknown base_quant {self.base_quant!r}; choose one of {', '.join(BASE_QUANTS)}")
        if self.base_quant != "float" and not self.lora_rank:
            raise ValueError(f"base_quant {self.base_quant} holds a LoRA run's frozen model: it needs lora_rank > 0")
        if self.dtype == "float64" and not jax.config.jax_enable_x64:
            raise ValueError("dtype float64 needs jax_enable_x64 (jax.config.update('jax_enable_x64', True))")
        check_precision({}, self.model_config())  # float16 compute: refused before any data is read
        max_len = self.model_config().max_seq_len
        if self.seq_len > max_len:
            raise ValueError(f"seq_len {self.seq_len} exceeds the {self.preset} model's max_seq_len "
                             f"{max_len}{' (with the model overrides)' if self.model else ''}")
        if self.packing not in PACKINGS:
            raise ValueError(f"unknown packing {self.packing!r}; choose one of {', '.join(PACKINGS)}")
        if self.mix:
            parse_mix(self.mix)  # DATA:WEIGHT, the weight in (0, 1)
        for name, value in (("epochs", self.epochs), ("packing conversations", self.packing == "conversations"),
                            ("mix", self.mix)):
            if value and not self.data:
                raise ValueError(f"{name} needs a prepared --data folder (`jaxformer prepare`); with "
                                 f"--corpus {self.corpus} give --steps")
        parse_mesh(self.mesh)  # the syntax; the device count is checked when the mesh is built
        if self.schedule != "constant" and self.warmup_steps >= _updates(self):
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must be smaller than the {_updates(self)} "
                f"optimizer updates of the run for the {self.schedule} schedule; lower "
                f"--warmup-steps, raise --steps or use --schedule constant")
        lora = self.lora()  # LoraConfig names a bad rank, alpha, dropout or target
        if lora is not None:  # and a target the model lacks (the MoE model's gate, ...)
            check_targets(self.model_config(), lora)
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
     "epochs", "eval_samples",  # epochs: the steps it gave are compared as steps
     "keep_checkpoints", "mesh", "data",  # data: the folder may move; its digests are checked
     "lora_base", "lora_base_digest",  # the base's path may move; its digest is checked (loop.lora_start)
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
    values.setdefault("grads", default_grads(preset, values["model"]))
    if flags.get("warmup_steps") is None:
        values["warmup_steps"] = fit_warmup(TrainSettings(**values))
    return TrainSettings(**values)


def default_grads(preset: str, model: dict) -> str:
    """The gradient source of a run that names none: "manual" (the hand-derived backward)
    wherever the attention_impl of ``model`` (ModelConfig overrides), else of the preset, has
    a pair in MANUAL_CORES (every core has), else "auto" (jax.grad)."""
    attention_impl = model.get("attention_impl", PRESETS[preset].attention_impl)
    return "manual" if attention_impl in MANUAL_CORES else "auto"


def grads_text(grads, config: ModelConfig) -> str:
    """The settings block's words for the gradient source ``grads`` (a GRAD_SOURCES name, or
    the function given to ``train``) of a run of ``config``."""
    if not isinstance(grads, str):
        name = getattr(grads, "__name__", "a function")
        return f"{name} (given to train as grad_fn, in place of settings.grads)"
    if grads == "manual":
        return "manual (the hand-derived backward, manual_grads; --grads auto for jax.grad)"
    return "auto (jax.grad; --grads manual for the hand-derived backward, manual_grads)"


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
    checkpoint predates take their ModelConfig defaults; a JSON list is the tuple it was written
    from (layer_types)."""
    defaults = ModelConfig().to_dict()
    defaults.pop("vocab_size")
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}
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
