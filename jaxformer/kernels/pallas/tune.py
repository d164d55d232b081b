"""The Pallas kernels' launch table on a GPU: for each (device kind, T, Dh, dtype, causal,
G) shape, the fastest (block_q, block_k, num_warps, num_stages) found by timing, kept in
``cache_path()`` (``$XDG_CACHE_HOME/jaxformer/pallas_launches.json``, else ``~/.cache/...``),
written atomically, and in memory for this process.

Two sides, kept apart:

- read: ``choice(shape)``, asked by tiling.plan while a model is traced, returns the
  table's entry for this process's GPU, or None (off a GPU, or a shape never tuned: the
  platform's default tiling then). It never times a kernel and never writes a file.
- write: ``choose(name, measure)`` times every candidate with ``measure`` and stores the
  fastest. Only the explicit tuning act calls it (timing.tune: ``jaxformer tune``, and
  ``jaxformer bench`` before it times the pallas step on a GPU). It takes the timer as an
  argument, so its selection and caching are tested on CPU with a fake one.

ModelConfig.pallas_block_q / pallas_block_k set (non-zero) win: plan asks only when both
are 0.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Callable, NamedTuple

import jax


class Shape(NamedTuple):
    """What the choice depends on, besides the device kind (static)."""
    T: int  # sequence length
    Dh: int  # head width
    dtype: str  # the products' dtype name ("bfloat16", "float32", ...)
    causal: bool
    G: int  # query heads per key/value head


class Choice(NamedTuple):
    block_q: int
    block_k: int
    num_warps: int
    num_stages: int


# A small grid: tiles from 32 to 128, 4 or 8 warps, 2 or 3 stages (8 compiles per shape).
CANDIDATES = (Choice(64, 64, 4, 2), Choice(64, 64, 4, 3), Choice(128, 64, 4, 2), Choice(128, 64, 8, 2),
              Choice(64, 128, 4, 2), Choice(128, 128, 8, 2), Choice(128, 128, 8, 3), Choice(32, 64, 4, 2))
_memory: dict[str, Choice] = {}  # key -> choice, this process


def cache_path() -> Path:
    """Where choices persist: $XDG_CACHE_HOME (else ~/.cache) / jaxformer / pallas_launches.json.
    (The older pallas_tune.json held choices timed on one sequence of 4 heads, too small a
    grid to rank the tiles: timing.TIMED_ROWS; it is left unread.)"""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "jaxformer" / "pallas_launches.json"


def key(device_kind: str, shape: Shape) -> str:
    """One cache entry's name, e.g. 'NVIDIA H100 80GB HBM3|T=1024|Dh=64|bfloat16|causal|G=1'."""
    return (f"{device_kind}|T={shape.T}|Dh={shape.Dh}|{shape.dtype}|"
            f"{'causal' if shape.causal else 'bidirectional'}|G={shape.G}")


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # no file yet, or a torn one from an older writer: tune again


def _write(path: Path, name: str, choice: Choice) -> None:
    """Add one entry to the JSON file atomically: a temp file in the same folder, then
    os.replace, so a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = _read(path)
    entries[name] = choice._asdict()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(entries, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def choose(name: str, measure: Callable[[Choice], float], candidates=CANDIDATES,
           path: Path | None = None, again: bool = False) -> Choice:
    """The stored choice for ``name`` (memory, then disk; ``again`` skips them); else the
    candidate with the least ``measure(choice)`` seconds (one that raises, e.g. out of
    shared memory, is skipped), then stored in both. ValueError when every candidate fails."""
    path = path or cache_path()
    if not again:
        if name in _memory:
            return _memory[name]
        stored = _read(path).get(name)
        if stored is not None:
            _memory[name] = Choice(**stored)
            return _memory[name]
    times = {}
    for c in candidates:
        try:
            times[c] = measure(c)
        except Exception:  # a launch the GPU cannot take: not a candidate
            times[c] = math.inf
    best = min(candidates, key=times.__getitem__)
    if times[best] == math.inf:
        raise ValueError(f"pallas autotune: no candidate launch ran for {name}")
    _memory[name] = best
    _write(path, name, best)
    return best


def device_kind() -> str | None:
    """This process's GPU, as the table names it ("NVIDIA H100 80GB HBM3"); None off a GPU."""
    return jax.devices()[0].device_kind if jax.default_backend() == "gpu" else None


def choice(shape: Shape) -> Choice | None:
    """The launch table's choice for ``shape`` on this process's GPU: None off a GPU or
    for a shape never tuned. Read only: what a traced model asks (tiling.plan)."""
    kind = device_kind()
    if kind is None:
        return None
    name = key(kind, shape)
    if name not in _memory and (stored := _read(cache_path()).get(name)) is not None:
        _memory[name] = Choice(**stored)
    return _memory.get(name)
