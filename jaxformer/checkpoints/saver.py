"""Asynchronous checkpoint saves: the training loop goes on while files are written.

``Saver(run_dir, keep).save(state, meta)`` holds the loop only for

    1. a finiteness check of every floating leaf, on the device (one bool per leaf
       comes back): a state with NaN or infinity is never saved (UnhealthyStateError);
    2. orbax's start of an async save: each process copies its own shards off the
       device (no gather to one host) and returns; the files are written by orbax's
       threads into a temporary folder, renamed into place when complete.

A finishing thread then waits for orbax, hashes every file written (in chunks,
digests.write_file_digests, process 0) and only then removes the checkpoints beyond
the ``keep`` newest: until the new one carries its digests, the previous one stays.
A kill at any moment leaves the previous checkpoints usable; a checkpoint without
its digest file is an unfinished save (treated as damaged on restore).

A failed write (disk full, permission denied, the folder removed) becomes one
CheckpointWriteError naming the path and the cause; orbax's thread tracebacks are
dropped (quiet.orbax_thread_noise) and the partial folder removed.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxformer.checkpoints.digests import write_file_digests
from jaxformer.checkpoints.errors import CheckpointWriteError, UnhealthyStateError
from jaxformer.checkpoints.quiet import orbax_thread_noise
from jaxformer.checkpoints.store import FORMAT_VERSION, checkpoint_dir, manager, step_dir


@jax.jit
def _finite_flags(leaves):
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def first_non_finite_on_device(state) -> str | None:
    """The path of the first floating leaf of ``state`` holding a NaN or an infinity
    (None: all finite), checked on the device: one bool per leaf comes back."""
    named = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
             if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not named:
        return None
    flags = _finite_flags([x for _, x in named])
    flags = np.asarray(flags.addressable_data(0)) if isinstance(flags, jax.Array) else np.asarray(flags)
    bad = [name for (name, _), ok in zip(named, flags) if not ok]
    return bad[0] if bad else None


def _cause(e: BaseException) -> str:
    """An OSError's strerror and code name (No space left on device (ENOSPC)), else the text."""
    for x in (e, e.__cause__, e.__context__):
        if isinstance(x, OSError) and x.errno:
            return f"{os.strerror(x.errno)} ({errno.errorcode.get(x.errno, x.errno)})"
    text = " ".join(str(e).split())
    for code, name in ((errno.ENOSPC, "ENOSPC"), (errno.EACCES, "EACCES"), (errno.ENOENT, "ENOENT")):
        if os.strerror(code).lower() in text.lower():
            return f"{os.strerror(code)} ({name})"
    return f"{type(e).__name__}: {text[:300]}"


class Saver:
    """The checkpoints of one run, saved asynchronously (see the module docstring)."""

    def __init__(self, run_dir, keep: int = 3):
        self.run_dir, self.keep = Path(run_dir), keep
        self._manager = None
        self._finishing: threading.Thread | None = None
        self._failed: tuple[int, BaseException] | None = None
        self.last_step: int | None = None  # the newest save started

    def save(self, state, meta: dict[str, Any]) -> Path:
        """Start saving ``state`` (a TrainState or any pytree with a ``step``) with the
        JSON-able ``meta`` as the checkpoint of its step; returns its folder. Raises
        UnhealthyStateError (nothing written) for a non-finite leaf, CheckpointWriteError
        when this or the previous save failed."""
        step = int(np.asarray(jax.device_get(state.step)))
        bad = first_non_finite_on_device(state)
        if bad is not None:
            raise UnhealthyStateError(f"not saving step {step}: state{bad} holds non-finite values")
        self.wait()
        if self._manager is None:
            self._manager = manager(self.run_dir, create=True, asynchronous=True)
        meta = dict(meta, step=step, format=FORMAT_VERSION)
        try:
            with orbax_thread_noise():
                self._manager.save(step, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        except Exception as e:  # noqa: BLE001 - every failed write is one named error
            raise self._write_error(step, e) from None
        self.last_step = step
        self._finishing = threading.Thread(target=self._finish, args=(step,), daemon=True,
                                           name=f"checkpoint-{step}")
        self._finishing.start()
        return step_dir(self.run_dir, step)

    def _finish(self, step: int) -> None:
        try:
            with orbax_thread_noise():
                self._manager.wait_until_finished()
            if jax.process_index() == 0:
                write_file_digests(step_dir(self.run_dir, step))
                self._drop_old(step)
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self._failed = (step, e)

    def _drop_old(self, newest: int) -> None:
        folder = checkpoint_dir(self.run_dir)
        steps = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir())
        for old in [s for s in steps if s < newest][: max(0, len(steps) - self.keep)]:
            shutil.rmtree(folder / str(old), ignore_errors=True)

    def wait(self) -> None:
        """Block until the save in flight is complete and digested; CheckpointWriteError
        when it failed (its partial folder removed)."""
        if self._finishing is not None:
            self._finishing.join()
            self._finishing = None
        if self._failed is not None:
            step, e = self._failed
            self._failed = None
            raise self._write_error(step, e)

    def _write_error(self, step: int, e: BaseException) -> CheckpointWriteError:
        """The one error of a failed save, after orbax's threads have stopped and the
        partial folder is gone (the manager is dropped: the next save starts afresh)."""
        with orbax_thread_noise():
            steps = [] if self._manager is None else [self._manager.wait_until_finished]
            steps += [t.join for t in threading.enumerate()  # orbax's threads of the failed save
                      if type(t).__name__ == "_SignalingThread" and t is not threading.current_thread()]
            if self._manager is not None:
                steps.append(self._manager.close)
            for step_ in steps:
                try:
                    step_()
                except Exception:  # noqa: BLE001 - the same failure, reported once below
                    pass
        self._manager = None
        folder = checkpoint_dir(self.run_dir)
        if jax.process_index() == 0 and folder.is_dir():
            for partial in folder.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
            done = folder / str(step)
            if done.is_dir() and not (done / "files.sha256.json").exists():
                shutil.rmtree(done, ignore_errors=True)
        self.last_step = None
        error = CheckpointWriteError(
            f"cannot write checkpoint step {step} to {folder}: {_cause(e)}; the partial checkpoint "
            "was removed, earlier checkpoints are intact")
        error.__cause__ = e  # a collective's error inside the save: liveness.may_be_a_lost_peer reads it
        return error

    def close(self) -> None:
        """Finish the save in flight (raising its error) and release orbax."""
        try:
            self.wait()
        finally:
            if self._manager is not None:
                with orbax_thread_noise():
                    self._manager.close()
                self._manager = None
