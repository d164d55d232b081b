"""Save and restore a whole TrainState with orbax-checkpoint.

A run folder keeps its checkpoints under ``<run>/checkpoints/<step>/``:

    state/   the TrainState pytree (step, params, opt_state, data_index, rng)
    meta/    JSON: model config, tokenizer, train settings, step, param dtype

orbax writes each checkpoint into a temporary folder and renames it into place
once complete, so a write that fails half way leaves the previous checkpoints as
they were (a leftover temporary folder is ignored on restore). Only the
``keep`` latest checkpoints are kept.

Every failure to find or read a checkpoint raises ``CheckpointError`` (a
ValueError) naming the path.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not fit what was asked for."""


def checkpoint_dir(run_dir) -> Path:
    return Path(run_dir).absolute() / CHECKPOINT_DIR


def _quiet_orbax():
    # orbax reports every save and restore at INFO level through absl logging
    logging.getLogger("absl").setLevel(logging.WARNING)


def _manager(run_dir, keep: int | None = None, create: bool = False) -> ocp.CheckpointManager:
    _quiet_orbax()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=create, enable_async_checkpointing=False,
    )
    return ocp.CheckpointManager(checkpoint_dir(run_dir), options=options)


def all_steps(run_dir) -> list[int]:
    """The steps of the complete checkpoints in ``run_dir``, ascending ([] when none)."""
    path = checkpoint_dir(run_dir)
    if not path.is_dir():
        return []
    return sorted(_manager(run_dir).all_steps())


def latest_step(run_dir) -> int | None:
    steps = all_steps(run_dir)
    return steps[-1] if steps else None


def _pick_step(run_dir, step: int | None) -> int:
    steps = all_steps(run_dir)
    path = checkpoint_dir(run_dir)
    if not steps:
        raise CheckpointError(f"no checkpoint found in {path}")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise CheckpointError(
            f"no checkpoint for step {step} in {path}; available: {', '.join(map(str, steps))}"
        )
    return step


def save(run_dir, state, meta: dict[str, Any], keep: int = 3) -> Path:
    """Write ``state`` (a TrainState or any pytree of arrays) and the JSON-able
    ``meta`` as the checkpoint of step ``int(state.step)``; keep the ``keep`` latest.
    Returns the checkpoint's folder."""
    step = int(jax.device_get(state.step))
    manager = _manager(run_dir, keep=keep, create=True)
    meta = dict(meta, step=step, format=FORMAT_VERSION)
    manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        force=True,
    )
    manager.wait_until_finished()
    manager.close()
    return checkpoint_dir(run_dir) / str(step)


def read_meta(run_dir, step: int | None = None) -> dict[str, Any]:
    """The meta dict of the latest checkpoint (or of ``step``)."""
    step = _pick_step(run_dir, step)
    path = checkpoint_dir(run_dir) / str(step)
    try:
        meta = _manager(run_dir).restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # noqa: BLE001 - any failure to read is a bad checkpoint
        raise CheckpointError(f"cannot read checkpoint {path}: {_short(e)}") from e
    if not isinstance(meta, dict) or "config" not in meta or "settings" not in meta:
        raise CheckpointError(f"checkpoint {path} has no valid meta data (config, settings)")
    return meta


def restore(run_dir, template, step: int | None = None):
    """The state of the latest checkpoint (or of ``step``), with the tree structure,
    shapes, dtypes and shardings of ``template`` (e.g. a freshly initialized state, or
    its ``jax.eval_shape`` with shardings): a checkpoint written on one mesh restores
    onto another."""
    step = _pick_step(run_dir, step)
    path = checkpoint_dir(run_dir) / str(step)
    # the restore target: each array lands in the sharding of ``template``'s leaf (the
    # current mesh's layout, whatever mesh wrote the checkpoint)
    target = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        template)
    try:
        restored = _manager(run_dir).restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
        ).state
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"cannot restore checkpoint {path}: {_short(e)}") from e
    want = jax.tree_util.tree_structure(template)
    if jax.tree_util.tree_structure(restored) != want:
        raise CheckpointError(f"checkpoint {path} holds a state of another structure")
    for got, exp in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(template)):
        if got.shape != exp.shape or got.dtype != exp.dtype:
            raise CheckpointError(
                f"checkpoint {path} holds an array {got.dtype}{list(got.shape)} where "
                f"{exp.dtype}{list(exp.shape)} is expected"
            )
    return restored


def _short(e: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(run_dir) -> str:
    steps = all_steps(run_dir)
    return f"{checkpoint_dir(run_dir)} (steps {', '.join(map(str, steps)) or 'none'})"


__all__ = [
    "CheckpointError", "checkpoint_dir", "all_steps", "latest_step", "save", "read_meta",
    "restore", "describe",
]
