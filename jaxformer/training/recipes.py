"""The fine-tuning recipes, and where each training setting of a run comes from.

A run's settings are layered, lowest first: TrainSettings' defaults, the preset's recipe
(config.PRESET_TRAINING), for a run that starts from a model (``--init-from``) the fine-tuning
recipe (``lora`` for adapters, ``full`` for every parameter; FINETUNE_RECIPES), a --config
file's [train] table, the flags; a resumed run starts from its checkpoint's settings. What a
recipe cannot know before the data and the model are read is sized to them (``size_to_run``):
the sequence length (a chat folder's longest conversation, at most the model's max_seq_len),
the steps of ``--epochs`` (rows of packed conversations per step), the warmup, evaluations
and checkpoints (fractions of the run). ``Sources`` records, for every field, which layer
gave its value; ``sources_block`` prints them (``lr  0.0002  (recipe lora)``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxformer import data
from jaxformer.data import packing
from jaxformer.training.fields import declared
from jaxformer.training.settings import TrainSettings

# Adapters learn at a higher rate than a full fine-tune, whose every weight moves (the
# values of PEFT's and the Hugging Face trainers' common LoRA / SFT recipes): AdamW, a short
# linear warmup, a cosine to a tenth of the peak, clipping at 1.
FINETUNE_RECIPES: dict[str, dict] = {
    "lora": dict(optimizer="adamw", lr=2e-4, schedule="cosine", beta1=0.9, beta2=0.999,
                 weight_decay=0.0, clip_norm=1.0, batch_size=8, eval_samples=3),
    "full": dict(optimizer="adamw", lr=2e-5, schedule="cosine", beta1=0.9, beta2=0.999,
                 weight_decay=0.01, clip_norm=1.0, batch_size=8, eval_samples=3),
}
WARMUP_FRACTION = 0.05  # of the run's updates
EVALS_PER_RUN = 5  # evaluations (and their sampled replies) spread over the run, the last at its end
CHECKPOINTS_PER_RUN = 4
CHAT_EPOCHS = 3  # a chat folder's passes when neither --steps nor --epochs is given
# A recipe's batch shrinks for a small dataset so that an epoch holds at least this many steps:
# 24 conversations at 8 rows a step made 3 epochs of 9 updates, too few for an adapter to learn
# a new fact at any sane rate; at 2 rows a step (33 updates) it does.
MIN_STEPS_PER_EPOCH = 10
TEXT_SEQ_LEN = 512  # a text corpus's rows (at most the model's max_seq_len)
MAX_CHAT_SEQ_LEN = 2048  # a chat folder's rows hold its longest conversation, up to this
ROUND = 64  # a chat row's length, rounded up to a multiple of this


def recipe_name(lora_rank: int) -> str:
    return "lora" if lora_rank else "full"


@dataclasses.dataclass
class Sources:
    """{field: where its value came from} ("default", "preset loopos", "recipe lora", "flag",
    "config FILE", "checkpoint", "data: ...", "model: ..."), and lines about the data."""
    of: dict = dataclasses.field(default_factory=dict)
    notes: list = dataclasses.field(default_factory=list)

    def layer(self, name: str, values: dict) -> None:
        """``values``' fields came from ``name`` (above the layers before it)."""
        for key, value in values.items():
            if value is not None:
                self.of[key] = name

    def get(self, key: str) -> str:
        return self.of.get(key, "default")

    def chosen(self, key: str) -> bool:
        """Whether the user chose the value (a flag, a config file, the checkpoint)."""
        source = self.get(key)
        return source == "flag" or source.startswith("config") or source == "checkpoint"


def chat_folder(data_dir: str | None) -> dict | None:
    """meta.json of a prepared chat folder (conversation starts recorded), else None."""
    if not data_dir:
        return None
    meta = data.read_meta(data_dir)
    return meta if meta.get("doc_starts") else None


def _split(data_dir: str, meta: dict, split: str):
    return data.open_split(data_dir, meta, split)


def longest_conversation(data_dir: str, meta: dict) -> int:
    ids = _split(data_dir, meta, "train")
    return int(packing.conversation_spans(np.asarray(ids.docs), len(ids))[1].max())


def size_to_run(settings: TrainSettings, sources: Sources, recipe: str | None,
                max_seq_len: int | None = None) -> TrainSettings:
    """``settings`` with what depends on the data and the run's length filled in: with a recipe
    (a run from a model), the fields no flag or file chose; ``--epochs`` always. ``max_seq_len``:
    the model's (the rows never exceed it)."""
    label = f"recipe {recipe}" if recipe else None
    changes: dict = {}
    chat = chat_folder(settings.data)
    if label and chat is not None:
        if not sources.chosen("packing"):
            changes["packing"] = "conversations"
            sources.of["packing"] = f"{label}: chat data"
        if not sources.chosen("seq_len"):
            longest = longest_conversation(settings.data, chat)
            want = min(MAX_CHAT_SEQ_LEN, ROUND * math.ceil(max(longest - 1, 1) / ROUND))
            if max_seq_len is not None and want > max_seq_len:
                want = max_seq_len
                sources.of["seq_len"] = f"model: its max_seq_len (longest conversation {longest} tokens)"
            else:
                sources.of["seq_len"] = f"data: longest conversation {longest} tokens"
            changes["seq_len"] = want
        if not sources.chosen("steps") and not sources.chosen("epochs"):
            changes["epochs"] = CHAT_EPOCHS
            sources.of["epochs"] = f"{label}: chat data"
    elif label and not sources.chosen("seq_len"):
        want = TEXT_SEQ_LEN if max_seq_len is None else min(TEXT_SEQ_LEN, max_seq_len)
        changes["seq_len"] = want
        sources.of["seq_len"] = label if want == TEXT_SEQ_LEN else "model: its max_seq_len"
    if label and (chat is None or not _has_val(settings.data, chat)) and not sources.chosen("eval_samples"):
        changes["eval_samples"] = 0
        sources.of["eval_samples"] = f"{label}: no chat validation split to sample"
    settings = settings.replace(**changes)
    if settings.epochs:
        settings = _epochs(settings, sources, chat, label)
    if label:
        settings = _spread(settings, sources, label)
    return settings


def _has_val(data_dir: str, meta: dict) -> bool:
    return bool(meta["splits"]["val"]["shards"]) and any(s["tokens"] for s in meta["splits"]["val"]["shards"])


def _epochs(settings: TrainSettings, sources: Sources, chat: dict | None, label: str | None = None) -> TrainSettings:
    """--epochs: the steps that pass over the folder's rows that many times. Under a recipe
    (``label``) whose batch no flag or file chose, a folder of few rows gets a smaller batch:
    at least MIN_STEPS_PER_EPOCH steps an epoch (one row a step at the least)."""
    if not settings.data:
        raise ValueError(f"epochs needs a prepared --data folder (`jaxformer prepare`); with --corpus "
                         f"{settings.corpus} give --steps")
    if sources.get("steps") == "flag" and sources.get("epochs") == "checkpoint":
        sources.of["epochs"] = "flag: --steps in its place"  # a resumed run lengthened by --steps
        return settings.replace(epochs=None)
    if sources.chosen("steps") and sources.get("steps") != "checkpoint":
        raise ValueError("give --epochs or --steps, not both (--epochs sets the steps from the data)")
    weight = packing.parse_mix(settings.mix)[1] if settings.mix else 0.0
    meta = data.read_meta(settings.data)
    ids = _split(settings.data, meta, "train")
    if settings.packing == "conversations":
        if chat is None:
            raise ValueError(f"packing conversations needs a chat data folder; {settings.data} holds none "
                             "(--packing windows)")
        mask = None if ids.mask is None else np.asarray(ids.mask)
        packed = packing.pack(np.asarray(ids), mask, np.asarray(ids.docs), settings.seq_len)
        rows = len(packed.tokens)
        cut = f", {packed.cut} cut to {settings.seq_len + 1} tokens" if packed.cut else ""
        what = (f"{packed.conversations:,} conversations{cut} in {rows:,} rows of {settings.seq_len + 1} "
                f"tokens")
    else:
        rows = max(1, (len(ids) - 1) // settings.seq_len)
        what = f"{len(ids):,} tokens in {rows:,} windows of {settings.seq_len + 1}"
    if label and not sources.chosen("batch_size"):
        fit = max(1, min(settings.batch_size, int(rows * (1 - weight)) // MIN_STEPS_PER_EPOCH))
        if fit < settings.batch_size:
            settings = settings.replace(batch_size=fit)
            sources.of["batch_size"] = (f"{label}: {rows:,} rows, at least {MIN_STEPS_PER_EPOCH} steps "
                                        f"an epoch")
    steps = packing.steps_for_epochs(settings.epochs, rows, settings.batch_size, weight)
    per_epoch = rows / (settings.batch_size * (1 - weight))
    mixed = f" ({1 - weight:.0%} of each batch; --mix the rest)" if weight else ""
    sources.notes.append(f"data: {what}; {settings.batch_size} rows a step{mixed}: {per_epoch:.4g} steps "
                         f"an epoch, {settings.epochs} epochs = {steps} steps")
    sources.of["steps"] = f"data: {settings.epochs} epochs x {per_epoch:.4g} steps"
    return settings.replace(steps=steps)


def _spread(settings: TrainSettings, sources: Sources, label: str) -> TrainSettings:
    """Warmup, evaluations and checkpoints as fractions of the run's length."""
    changes = {}
    updates = -(-settings.steps // settings.accum_steps)
    if not sources.chosen("warmup_steps"):
        changes["warmup_steps"] = min(int(updates * WARMUP_FRACTION), max(updates - 1, 0))
        sources.of["warmup_steps"] = f"{label}: {WARMUP_FRACTION:.0%} of the run's updates"
    if not sources.chosen("eval_every"):
        changes["eval_every"] = max(1, settings.steps // EVALS_PER_RUN)
        sources.of["eval_every"] = f"{label}: {EVALS_PER_RUN} in the run"
    if not sources.chosen("ckpt_every"):
        changes["ckpt_every"] = max(1, settings.steps // CHECKPOINTS_PER_RUN)
        sources.of["ckpt_every"] = f"{label}: {CHECKPOINTS_PER_RUN} in the run"
    return settings.replace(**changes)


def _text(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if value is None:
        return "none"
    return '""' if value == "" else str(value)


def sources_block(settings: TrainSettings, sources: Sources) -> list[str]:
    """Where the settings came from: one line per value a preset, recipe, file, flag,
    checkpoint or the data gave; every other setting is TrainSettings' default (the loop's
    settings block, printed next, lists every value)."""
    named = [(f.name, _text(getattr(settings, f.name)), sources.get(f.name)) for f in declared(TrainSettings)
             if f.name not in ("model", "lora_base_digest") and sources.get(f.name) != "default"]
    width = max((len(n) for n, _, _ in named), default=0)
    vwidth = max((len(v) for _, v, _ in named), default=0)
    lines = ["settings not at their defaults, and where each came from"]
    lines += [f"  {n:<{width}}  {v:<{vwidth}}  ({s})" for n, v, s in named]
    lines += [f"  {note}" for note in sources.notes]
    return lines
