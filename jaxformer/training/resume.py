"""Resuming a run: what may change since its checkpoint, and the checks that refuse
the rest.

A resumed run's settings may differ from its checkpoint's only in RESUMABLE_CHANGES
(settings.py; a CheckpointError names any other differing field, the model compared
field by field after resolving overrides). It keeps the schedule horizon it started
with unless ``settings.schedule_steps`` says otherwise (``keep_schedule``), restores
the newest checkpoint that verifies (damaged newer ones are set aside), and refuses
a changed corpus or tokenizer (DataChangedError) unless allowed. The meta saved with
every checkpoint (``checkpoint_meta``) holds what these checks compare against.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from jaxformer.checkpoints import checkpoint
from jaxformer.data import shards_fingerprint, tokenizer_from_dict
from jaxformer.model.config import ModelConfig
from jaxformer.training.configfile import PATH_FIELDS, same_path
from jaxformer.training.settings import (RESUMABLE_CHANGES, TrainSettings, config_diff, diff_fields,
                                         keep_schedule)


class DataChangedError(ValueError):
    """A resumed run's corpus or tokenizer differs from the one it was trained on."""


def _say(message: str) -> None:
    print(message, file=sys.stderr)


def checkpoint_meta(config: ModelConfig, tokenizer, settings: TrainSettings,
                    fingerprint: dict | None = None) -> dict:
    """The meta saved with each checkpoint: model config, tokenizer, train settings,
    param dtype and the data's fingerprint (``data_fingerprint``)."""
    meta = {"config": config.to_dict(), "tokenizer": tokenizer.to_dict(),
            "settings": settings.to_dict(), "param_dtype": settings.dtype}
    if fingerprint is not None:
        meta["data"] = fingerprint
    return meta


def data_fingerprint(corpus: bytes, tokenizer) -> dict:
    """sha256 of the corpus bytes and of the tokenizer's JSON, recorded with the run."""
    tok = json.dumps(tokenizer.to_dict(), sort_keys=True).encode()
    return {"corpus_sha256": hashlib.sha256(corpus).hexdigest(),
            "tokenizer_sha256": hashlib.sha256(tok).hexdigest()}


def prepared_fingerprint(meta: dict, tokenizer) -> dict:
    """data_fingerprint of a prepared folder: its shard digests (from meta.json, no
    shard re-hashed) and the tokenizer's JSON."""
    tok = json.dumps(tokenizer.to_dict(), sort_keys=True).encode()
    return {"corpus_sha256": shards_fingerprint(meta),
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


def check_resume(run_dir: Path, settings: TrainSettings, saved_meta: dict) -> dict:
    """The checkpoint's meta ``saved_meta``, after checking that it fits ``settings``."""
    tokenizer = tokenizer_from_dict(saved_meta["tokenizer"])
    requested = settings.model_config(tokenizer.vocab_size)
    model_diff = config_diff(saved_meta["config"], requested)
    saved = TrainSettings.from_dict(saved_meta["settings"]).to_dict()
    settings_diff = diff_fields(saved, settings.to_dict(), ignore=RESUMABLE_CHANGES | {"model"})
    problems = []
    if (saved["clip_norm"] is None) != (settings.clip_norm is None):
        problems.append(f"gradient-norm clipping cannot be turned {'on' if saved['clip_norm'] is None else 'off'} "
                        "on resume (--clip-norm changes the optimizer state; start a new run)")
    for name in ("lr", "muon_lr", "clip_norm"):
        if saved[name] != getattr(settings, name) and not problems:
            _say(f"note: resuming with {name} {getattr(settings, name)} (the checkpoint was trained "
                 f"with {saved[name]})")
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


def check_fresh(run_dir: Path) -> None:
    """A new run must not start over the checkpoints of another."""
    if checkpoint.all_steps(run_dir):
        raise ValueError(
            f"{run_dir} already holds checkpoints; resume it (--resume) or choose another folder"
        )


def resume_settings(run_dir: Path, settings: TrainSettings) -> tuple[TrainSettings, dict]:
    """(the settings to resume with, the meta of the newest checkpoint whose meta reads):
    a path that names the checkpoint's file or folder in another spelling (config.toml's
    absolute one) taken as the checkpoint spells it, the schedule horizon kept (a note on
    stderr when that matters), the rest checked against the checkpoint (``check_resume``)."""
    saved_meta = checkpoint.newest_meta(run_dir)
    saved = TrainSettings.from_dict(saved_meta["settings"])
    same = {name: getattr(saved, name) for name in PATH_FIELDS
            if same_path(name, getattr(saved, name), getattr(settings, name))}
    settings, note = keep_schedule(settings.replace(**same), saved)
    if note:
        _say(note)
    return settings, check_resume(run_dir, settings, saved_meta)


def restore_newest(run_dir: Path, template):
    """The state of the newest checkpoint that verifies, laid out like ``template``
    (each one skipped is reported); newer damaged ones are moved out of the way of
    the checkpoints this run will write (``checkpoint.set_aside``)."""
    from_step, state = checkpoint.load_newest_good(
        run_dir, lambda s: checkpoint.restore(run_dir, template, s))
    _say(f"resuming from checkpoint step {from_step} "
         f"({checkpoint.checkpoint_dir(run_dir) / str(from_step)})")
    newer = [s for s in checkpoint.all_steps(run_dir) if s > from_step]
    if jax.process_index() == 0:  # the run folder is shared: one process moves, the rest wait
        for step in newer:
            _say(f"moved the damaged checkpoint of step {step} to {checkpoint.set_aside(run_dir, step)}")
    if jax.process_count() > 1:  # every process, whatever list it saw
        multihost_utils.sync_global_devices("jaxformer: damaged checkpoints set aside")
    return state
