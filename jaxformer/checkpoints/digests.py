"""The sha256 digests that prove a checkpoint reads back as it was written.

Two kinds, both checked on every restore:

    files.sha256.json   in each step folder: the size and sha256 of every file orbax
                        wrote, written last (``write_file_digests``, ``verify_files``)
    meta["digests"]     the sha256 of every saved array, computed from its host values
                        (``array_digests``, ``verify_arrays``)

A file whose bytes changed or were cut short is named by the file digests; an array
that reads back different values by the array digests.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import jax
import numpy as np

from jaxformer.checkpoints.errors import DamagedCheckpointError, one_line

FILE_DIGESTS = "files.sha256.json"


CHUNK = 1 << 22  # bytes read at a time: a file is never read into memory whole


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read CHUNK bytes at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


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


def verify_arrays(recorded: dict[str, str] | None, host_state, step: int, where: Path) -> None:
    """Raise DamagedCheckpointError naming the first array of ``host_state`` whose digest
    differs from ``recorded`` (a checkpoint written before array digests existed has
    none: nothing to check). ``where``: the checkpoint's folder, for the message."""
    if not recorded:
        return
    got = array_digests(host_state)
    for name, digest in recorded.items():
        if got.get(name) != digest:
            raise DamagedCheckpointError(
                f"checkpoint step {step} is damaged: state{name} in {where} "
                "differs from its recorded sha256")


def _file_digests(step_dir: Path) -> dict[str, list]:
    return {
        str(f.relative_to(step_dir)): [f.stat().st_size, file_sha256(f)]
        for f in sorted(step_dir.rglob("*")) if f.is_file() and f.name != FILE_DIGESTS
    }


def write_file_digests(step_dir: Path) -> None:
    """Record the size and sha256 of every file in ``step_dir`` (written atomically)."""
    tmp = step_dir / (FILE_DIGESTS + ".tmp")
    tmp.write_text(json.dumps(_file_digests(step_dir), indent=0))
    os.replace(tmp, step_dir / FILE_DIGESTS)


def verify_files(step: int, step_dir: Path, required: bool = True) -> None:
    """Raise DamagedCheckpointError naming the first file that differs from its digest.
    Without a digest file: damaged when ``required`` (a save cut off before it was
    digested), else (a format-1 checkpoint) its arrays are verified on restore."""
    listing = step_dir / FILE_DIGESTS
    if not listing.exists():
        if required:
            raise DamagedCheckpointError(
                f"checkpoint step {step} is damaged: {listing} is missing (the save did not finish)")
        return
    try:
        recorded = json.loads(listing.read_text())
    except (OSError, ValueError) as e:
        raise DamagedCheckpointError(
            f"checkpoint step {step} is damaged: {listing} is unreadable ({one_line(e)})") from None
    for name, (size, digest) in recorded.items():
        f = step_dir / name
        if not f.is_file():
            raise DamagedCheckpointError(f"checkpoint step {step} is damaged: {f} is missing")
        got = f.stat().st_size
        if got != size:
            raise DamagedCheckpointError(
                f"checkpoint step {step} is damaged: {f} has {got} bytes, {size} were written")
        if file_sha256(f) != digest:
            raise DamagedCheckpointError(
                f"checkpoint step {step} is damaged: the bytes of {f} differ from their recorded sha256")
