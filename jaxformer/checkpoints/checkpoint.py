"""Save and restore a whole TrainState with orbax-checkpoint.

A run folder keeps its checkpoints under ``<run>/checkpoints/<step>/``:

    state/   the TrainState pytree (step, params, opt_state, data_index, rng), each
             process writing its own shards
    meta/    JSON: model config, tokenizer, train settings, step, param dtype, format
    files.sha256.json   the sha256 and size of every file orbax wrote, written last,
             once the save is complete (format 2: required)

Saves are asynchronous (saver.py: the loop holds only for a finiteness check on the
device and orbax's copy off the device). Every restore verifies the file digests
(digests.py; a format-1 checkpoint also carries array digests, checked as well) and
lands each array straight in its target sharding.

What counts as damage (errors.is_damage): a digest mismatch, a missing file (the
digest file included: a save that did not finish) or a file that does not decode.
``load_newest_good`` falls back past damaged checkpoints only, reporting each; any
other failure (out of memory, an I/O error, a sharding that does not fit) stops with
its cause as a CheckpointReadError and nothing is moved.

orbax writes each checkpoint into a temporary folder and renames it into place
once complete; a leftover temporary folder is ignored. Only the ``keep`` latest
checkpoints are kept, the older ones removed once a newer one is digested.

Every failure to find or read a checkpoint raises ``CheckpointError`` (a
ValueError) naming the path (errors.py). Reading a run folder back with its model
config and tokenizer is runs.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxformer.checkpoints.digests import (FILE_DIGESTS, array_digests, first_non_finite,
                                           verify_arrays, verify_files)
from jaxformer.checkpoints.errors import (CheckpointError, CheckpointReadError,
                                          CheckpointWriteError, DamagedCheckpointError,
                                          UnhealthyStateError, is_damage, one_line)
from jaxformer.checkpoints.quiet import silenced
from jaxformer.checkpoints.saver import Saver, first_non_finite_on_device
from jaxformer.checkpoints.store import (CHECKPOINT_DIR, DAMAGED_DIR, FORMAT_VERSION, checkpoint_dir,
                                         manager)

def warn(message: str) -> None:
    """A one-line warning on stderr (the default reporter of skipped checkpoints)."""
    print(f"warning: {message}", file=sys.stderr)


def _restore(run_dir, step: int, args):
    mgr = manager(run_dir)
    try:
        return mgr.restore(step, args=args)
    finally:
        mgr.close()


def all_steps(run_dir) -> list[int]:
    """The steps of the complete checkpoints in ``run_dir``, ascending ([] when none)."""
    path = checkpoint_dir(run_dir)
    if not path.is_dir():
        return []
    mgr = manager(run_dir)
    try:
        return sorted(mgr.all_steps())
    finally:
        mgr.close()


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


def to_host(tree):
    """``tree`` as numpy arrays on this host; an array sharded over several processes is
    gathered whole first. Only the array digests of format-1 checkpoints need this."""
    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree_util.tree_map(one, tree)


def save(run_dir, state, meta: dict[str, Any], keep: int = 3) -> Path:
    """Write ``state`` (a TrainState or any pytree with a ``step``) and the JSON-able
    ``meta`` as the checkpoint of step ``int(state.step)`` and wait until it is complete
    and digested; keep the ``keep`` latest. Returns the checkpoint's folder. The loop
    saves asynchronously with a ``Saver`` instead.
    Raises UnhealthyStateError (nothing written) when a leaf holds NaN or infinity,
    CheckpointWriteError when the write fails."""
    saver = Saver(run_dir, keep)
    try:
        return saver.save(state, meta)
    finally:
        saver.close()


def read_meta(run_dir, step: int | None = None) -> dict[str, Any]:
    """The meta dict of the latest checkpoint (or of ``step``)."""
    step = _pick_step(run_dir, step)
    path = checkpoint_dir(run_dir) / str(step)
    try:
        with silenced():
            meta = _restore(run_dir, step, ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # noqa: BLE001 - sorted into damage and the rest (read_failure)
        raise read_failure(e, step, path, "read") from None
    if not isinstance(meta, dict) or "config" not in meta or "settings" not in meta:
        raise DamagedCheckpointError(
            f"checkpoint step {step} is damaged: {path} has no valid meta data (config, settings)")
    return meta


def set_aside(run_dir, step: int) -> Path:
    """Move checkpoint ``step`` (one that failed to verify) out of the way of new saves,
    to ``<run>/damaged_checkpoints/<step>``; returns its new folder."""
    target = Path(run_dir).absolute() / DAMAGED_DIR / str(step)
    if target.exists():
        target = target.with_name(f"{step}-{len(list(target.parent.iterdir()))}")
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(checkpoint_dir(run_dir) / str(step), target)
    return target


def newest_meta(run_dir) -> dict[str, Any]:
    """The meta dict of the newest checkpoint whose meta reads (damaged ones skipped
    silently: restoring the state reports them)."""
    return load_newest_good(run_dir, lambda s: read_meta(run_dir, s), report=None)[1]


def restore(run_dir, template, step: int | None = None):
    """The state of the latest checkpoint (or of ``step``), with the tree structure,
    shapes, dtypes and shardings of ``template`` (e.g. a freshly initialized state, or
    its ``jax.eval_shape`` with shardings): a checkpoint written on one mesh restores
    onto another.

    Verified: DamagedCheckpointError names the file or array that differs from the
    digests recorded at save time."""
    return _restore_state(run_dir, template, step, partial=False)


def restore_params(run_dir, template: dict, step: int | None = None) -> dict:
    """Only some fields of the saved state, e.g. ``{"params": ..., "data_index": ...}``
    (shapes as for ``restore``): sampling and diagnosis never read the optimizer state
    into memory. Verified like ``restore`` (the digests of every file are checked)."""
    return _restore_state(run_dir, template, step, partial=True)


def _restore_state(run_dir, template, step: int | None, partial: bool):
    step = _pick_step(run_dir, step)
    path = checkpoint_dir(run_dir) / str(step)
    meta = read_meta(run_dir, step)
    verify_files(step, path, required=meta.get("format", 1) >= 2)
    # the restore target: each array lands in the sharding of ``template``'s leaf (the
    # current mesh's layout, whatever mesh wrote the checkpoint)
    target = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        template)
    args = (ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                   restore_args=ocp.checkpoint_utils.construct_restore_args(target))
            if partial else ocp.args.StandardRestore(target))
    try:
        with silenced():
            restored = _restore(run_dir, step, ocp.args.Composite(state=args)).state
    except Exception as e:  # noqa: BLE001 - sorted into damage and the rest (read_failure)
        raise read_failure(e, step, path, "restore") from None
    want = jax.tree_util.tree_structure(template)
    if jax.tree_util.tree_structure(restored) != want:
        raise CheckpointError(f"checkpoint {path} holds a state of another structure")
    for got, exp in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(template)):
        if got.shape != exp.shape or got.dtype != exp.dtype:
            raise CheckpointError(
                f"checkpoint {path} holds an array {got.dtype}{list(got.shape)} where "
                f"{exp.dtype}{list(exp.shape)} is expected"
            )
    if meta.get("digests") and not partial:  # a format-1 checkpoint: array digests of the host values
        verify_arrays(meta["digests"], to_host(restored), step, path)
    return restored


def read_failure(e: Exception, step: int, path: Path, what: str) -> CheckpointError:
    """The error for a failed read of checkpoint ``step``: DamagedCheckpointError when
    the failure is damage (errors.is_damage: a missing or undecodable file), else a
    CheckpointReadError that names the real cause and says nothing was moved."""
    if is_damage(e):
        return DamagedCheckpointError(
            f"checkpoint step {step} is damaged: cannot {what} {path}: {one_line(e)}")
    return CheckpointReadError(
        f"cannot {what} checkpoint {path} (step {step}): {one_line(e)}; the checkpoint is not "
        "damaged and was left where it is")


def load_newest_good(run_dir, load: Callable[[int], Any], step: int | None = None,
                     report: Callable[[str], None] | None = warn):
    """(step, load(step)) for the newest checkpoint whose ``load`` succeeds; each one
    skipped as damaged (a DamagedCheckpointError: a digest mismatch, a missing or an
    undecodable file) is reported in one line. Any other error stops the search and
    propagates: a good checkpoint is never passed over for an out-of-memory or I/O
    error. With ``step`` given, only that one is tried. Raises CheckpointError naming
    every reason when none loads."""
    steps = [_pick_step(run_dir, step)] if step is not None else all_steps(run_dir)[::-1]
    if not steps:
        _pick_step(run_dir, None)  # raises: no checkpoint found
    reasons = []
    for s in steps:
        try:
            value = load(s)
        except DamagedCheckpointError as e:
            reasons.append((s, " ".join(str(e).split())))
            continue
        for skipped, reason in reasons:
            if report is not None:
                report(f"skipped checkpoint step {skipped}, using step {s}: {reason}")
        return s, value
    reasons = [reason for _, reason in reasons]
    if len(reasons) == 1:
        raise CheckpointError(reasons[0])
    raise CheckpointError(
        f"no checkpoint in {checkpoint_dir(run_dir)} verifies: {'; '.join(reasons)}")


__all__ = [
    "CHECKPOINT_DIR", "DAMAGED_DIR", "FILE_DIGESTS", "FORMAT_VERSION",
    "CheckpointError", "CheckpointReadError", "CheckpointWriteError", "DamagedCheckpointError",
    "Saver", "first_non_finite_on_device", "UnhealthyStateError", "checkpoint_dir",
    "all_steps", "latest_step", "save", "read_meta", "newest_meta", "set_aside", "restore",
    "restore_params",
    "load_newest_good", "array_digests", "first_non_finite", "to_host", "warn",
]
