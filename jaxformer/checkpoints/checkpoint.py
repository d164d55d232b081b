"""Save and restore a whole TrainState with orbax-checkpoint.

A run folder keeps its checkpoints under ``<run>/checkpoints/<step>/``:

    state/   the TrainState pytree (step, params, opt_state, data_index, rng)
    meta/    JSON: model config, tokenizer, train settings, step, param dtype, and
             ``digests``: the sha256 of every saved array, computed from its host values
    files.sha256.json   the sha256 and size of every file orbax wrote, written last

Every restore verifies both: a file whose bytes changed or were cut short is named
by the file digests; an array that reads back different values by the array
digests. ``load_newest_good`` falls back to the newest checkpoint that verifies
and reports each one it skips. ``save`` refuses a state with non-finite values, so
every checkpoint on disk is a healthy one.

orbax writes each checkpoint into a temporary folder and renames it into place
once complete, so a write that fails half way leaves the previous checkpoints as
they were (a leftover temporary folder is ignored on restore). Only the
``keep`` latest checkpoints are kept.

Every failure to find or read a checkpoint raises ``CheckpointError`` (a
ValueError) naming the path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"
FORMAT_VERSION = 1
FILE_DIGESTS = "files.sha256.json"
DAMAGED_DIR = "damaged_checkpoints"


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not fit what was asked for."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files or arrays do not match the digests recorded when it was saved."""


class UnhealthyStateError(CheckpointError):
    """A state with non-finite values was not saved."""


def checkpoint_dir(run_dir) -> Path:
    return Path(run_dir).absolute() / CHECKPOINT_DIR


def _quiet_orbax():
    # orbax reports every save and restore at INFO level through absl logging
    logging.getLogger("absl").setLevel(logging.WARNING)


@contextlib.contextmanager
def _silenced():
    """No log lines (orbax logs the tracebacks of failed reads from its worker threads):
    a failed read is reported once, as the CheckpointError it becomes."""
    _drop_closed_loop_noise()
    loggers = [logging.getLogger(name) for name in ("absl", "orbax", "jax", "tensorstore")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _drop_closed_loop_noise() -> None:
    """After a failed read, orbax's leftover read coroutines and callbacks fail again
    when collected or when they hit their closed asyncio loop, and Python prints each
    as an "Exception ignored" traceback; drop those (only those): the failure itself is
    reported once, as a CheckpointError."""
    hook = sys.unraisablehook
    if getattr(hook, "_jaxformer_filter", False):
        return

    def unraisable(info):
        code = getattr(info.object, "cr_code", None)
        if code is not None and "orbax" in code.co_filename:
            return
        if isinstance(info.exc_value, RuntimeError) and "Event loop is closed" in str(info.exc_value):
            return
        hook(info)

    unraisable._jaxformer_filter = True
    sys.unraisablehook = unraisable


def warn(message: str) -> None:
    """A one-line warning on stderr (the default reporter of skipped checkpoints)."""
    print(f"warning: {message}", file=sys.stderr)


# ----------------------------------------------------------------------------
# digests


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def array_digests(host_state) -> dict[str, str]:
    """{leaf path: sha256 of dtype, shape and bytes} of a pytree of host arrays."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(host_state)[0]:
        a = np.ascontiguousarray(np.asarray(leaf))
        out[jax.tree_util.keystr(path)] = _sha256(f"{a.dtype.str}{a.shape}".encode() + a.tobytes())
    return out


def first_non_finite(host_state) -> str | None:
    """The path of the first floating leaf holding a NaN or an infinity (None: all finite)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(host_state)[0]:
        a = np.asarray(leaf)
        if np.issubdtype(a.dtype, np.inexact) and not np.all(np.isfinite(a)):
            return jax.tree_util.keystr(path)
    return None


def _file_digests(step_dir: Path) -> dict[str, list]:
    return {
        str(f.relative_to(step_dir)): [f.stat().st_size, _sha256(f.read_bytes())]
        for f in sorted(step_dir.rglob("*")) if f.is_file() and f.name != FILE_DIGESTS
    }


def _write_file_digests(step_dir: Path) -> None:
    tmp = step_dir / (FILE_DIGESTS + ".tmp")
    tmp.write_text(json.dumps(_file_digests(step_dir), indent=0))
    os.replace(tmp, step_dir / FILE_DIGESTS)


def _verify_files(step: int, step_dir: Path) -> None:
    """Raise DamagedCheckpointError naming the first file that differs from its digest.
    A checkpoint written before file digests existed (or cut off right after orbax
    committed it) has no digest file: its arrays are still verified on restore."""
    listing = step_dir / FILE_DIGESTS
    if not listing.exists():
        return
    try:
        recorded = json.loads(listing.read_text())
    except (OSError, ValueError) as e:
        raise DamagedCheckpointError(
            f"checkpoint step {step} is damaged: {listing} is unreadable ({_short(e)})") from None
    for name, (size, digest) in recorded.items():
        f = step_dir / name
        if not f.is_file():
            raise DamagedCheckpointError(f"checkpoint step {step} is damaged: {f} is missing")
        data = f.read_bytes()
        if len(data) != size:
            raise DamagedCheckpointError(
                f"checkpoint step {step} is damaged: {f} has {len(data)} bytes, {size} were written")
        if _sha256(data) != digest:
            raise DamagedCheckpointError(
                f"checkpoint step {step} is damaged: the bytes of {f} differ from their recorded sha256")


def _manager(run_dir, keep: int | None = None, create: bool = False) -> ocp.CheckpointManager:
    _quiet_orbax()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=create, enable_async_checkpointing=False,
    )
    return ocp.CheckpointManager(checkpoint_dir(run_dir), options=options)


def _restore(run_dir, step: int, args):
    manager = _manager(run_dir)
    try:
        return manager.restore(step, args=args)
    finally:
        manager.close()


def all_steps(run_dir) -> list[int]:
    """The steps of the complete checkpoints in ``run_dir``, ascending ([] when none)."""
    path = checkpoint_dir(run_dir)
    if not path.is_dir():
        return []
    manager = _manager(run_dir)
    try:
        return sorted(manager.all_steps())
    finally:
        manager.close()


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
    """``tree`` as numpy arrays on this host. An array sharded over several processes
    (a multi-process mesh) is gathered whole first, so every process hashes the same
    values."""
    from jax.experimental import multihost_utils

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree_util.tree_map(one, tree)


def save(run_dir, state, meta: dict[str, Any], keep: int = 3) -> Path:
    """Write ``state`` (a TrainState or any pytree of arrays) and the JSON-able
    ``meta`` as the checkpoint of step ``int(state.step)``; keep the ``keep`` latest.
    Returns the checkpoint's folder.
    Raises UnhealthyStateError (nothing written) when a leaf holds NaN or infinity."""
    host = to_host(state)
    step = int(host.step) if hasattr(host, "step") else int(to_host(state.step))
    bad = first_non_finite(host)
    if bad is not None:
        raise UnhealthyStateError(
            f"not saving step {step}: state{bad} holds non-finite values")
    manager = _manager(run_dir, keep=keep, create=True)
    meta = dict(meta, step=step, format=FORMAT_VERSION, digests=array_digests(host))
    manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        force=True,
    )
    manager.wait_until_finished()
    manager.close()
    step_dir = checkpoint_dir(run_dir) / str(step)
    if jax.process_index() == 0:
        _write_file_digests(step_dir)
    return step_dir


def read_meta(run_dir, step: int | None = None) -> dict[str, Any]:
    """The meta dict of the latest checkpoint (or of ``step``)."""
    step = _pick_step(run_dir, step)
    path = checkpoint_dir(run_dir) / str(step)
    try:
        with _silenced():
            meta = _restore(run_dir, step, ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # noqa: BLE001 - any failure to read is a bad checkpoint
        raise CheckpointError(f"cannot read checkpoint {path} (step {step}): {_short(e)}") from None
    if not isinstance(meta, dict) or "config" not in meta or "settings" not in meta:
        raise CheckpointError(f"checkpoint {path} has no valid meta data (config, settings)")
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
    step = _pick_step(run_dir, step)
    path = checkpoint_dir(run_dir) / str(step)
    _verify_files(step, path)
    # the restore target: each array lands in the sharding of ``template``'s leaf (the
    # current mesh's layout, whatever mesh wrote the checkpoint)
    target = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        template)
    try:
        with _silenced():
            restored = _restore(
                run_dir, step, ocp.args.Composite(state=ocp.args.StandardRestore(target))).state
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"cannot restore checkpoint {path} (step {step}): {_short(e)}") from None
    want = jax.tree_util.tree_structure(template)
    if jax.tree_util.tree_structure(restored) != want:
        raise CheckpointError(f"checkpoint {path} holds a state of another structure")
    for got, exp in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(template)):
        if got.shape != exp.shape or got.dtype != exp.dtype:
            raise CheckpointError(
                f"checkpoint {path} holds an array {got.dtype}{list(got.shape)} where "
                f"{exp.dtype}{list(exp.shape)} is expected"
            )
    _verify_arrays(run_dir, step, restored)
    return restored


def _verify_arrays(run_dir, step: int, restored) -> None:
    recorded = read_meta(run_dir, step).get("digests")
    if not recorded:  # written before array digests existed
        return
    got = array_digests(to_host(restored))
    for name, digest in recorded.items():
        if got.get(name) != digest:
            raise DamagedCheckpointError(
                f"checkpoint step {step} is damaged: state{name} in {checkpoint_dir(run_dir) / str(step)} "
                "differs from its recorded sha256")


def load_newest_good(run_dir, load: Callable[[int], Any], step: int | None = None,
                     report: Callable[[str], None] | None = warn):
    """(step, load(step)) for the newest checkpoint whose ``load`` succeeds; each one
    skipped for a CheckpointError is reported in one line. With ``step`` given, only
    that one is tried. Raises CheckpointError naming every reason when none loads."""
    steps = [_pick_step(run_dir, step)] if step is not None else all_steps(run_dir)[::-1]
    if not steps:
        _pick_step(run_dir, None)  # raises: no checkpoint found
    reasons = []
    for s in steps:
        try:
            value = load(s)
        except CheckpointError as e:
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


def _short(e: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe(run_dir) -> str:
    steps = all_steps(run_dir)
    return f"{checkpoint_dir(run_dir)} (steps {', '.join(map(str, steps)) or 'none'})"


__all__ = [
    "CheckpointError", "DamagedCheckpointError", "UnhealthyStateError", "checkpoint_dir",
    "all_steps", "latest_step", "save", "read_meta", "newest_meta", "set_aside", "restore", "load_newest_good", "describe",
    "array_digests", "first_non_finite", "warn",
]
