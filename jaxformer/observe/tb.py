"""TensorBoard event files in the run folder, next to metrics.jsonl.

Written with tensorboardX (no TensorFlow needed); ``tensorboard --logdir RUN``
shows them. Each metrics record becomes scalars at its step:

  train/loss, train/grad_norm, train/lr (train/muon_lr), train/tokens_per_s (steady-state
  intervals only: the record that carries compile_s is left out),
  val/loss, val/bits_per_byte or val/bits_per_char, run/resumed (1 where a run
  was resumed).
"""

from __future__ import annotations

import socket
import struct
import sys
import time
from pathlib import Path

TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr",
        "muon_lr": "train/muon_lr",
        "tokens_per_s": "train/tokens_per_s", "val_loss": "val/loss",
        "val_bits_per_byte": "val/bits_per_byte", "val_bits_per_char": "val/bits_per_char",
        "resumed": "run/resumed"}


def tensorboardx():
    """tensorboardX's (Event, SessionLog, Summary, RecordWriter). Its package ``__init__``
    imports its SummaryWriter module, which imports torch where torch is installed: over a
    second of every training start, for type annotations only (tensorboardX imports torch
    again in the functions that use it). The event file needs neither, so while tensorboardX
    first loads, ``import torch`` fails as where torch is missing; afterwards torch imports
    as usual (``python -X importtime -m jaxformer train ...`` shows it gone)."""
    refuse = "torch" not in sys.modules and "tensorboardX" not in sys.modules
    if refuse:
        sys.modules["torch"] = None  # import torch raises ImportError, which tensorboardX catches
    try:
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.record_writer import RecordWriter
    finally:
        if refuse and sys.modules.get("torch", False) is None:
            del sys.modules["torch"]
    return Event, SessionLog, Summary, RecordWriter


class EventLog:
    """An event file in ``run_dir``, written in the caller's thread through tensorboardX's
    ``RecordWriter`` (no writer thread, no exit hook: a failed write, a full disk, is an
    OSError of ``write`` or ``close``, and nothing is left to fail later); ``purge_step``
    drops events at or after that step left by an interrupted run (a resumed run writes
    them again). The file is flushed every FLUSH_S seconds and at ``close``."""

    FLUSH_S = 30.0

    def __init__(self, run_dir, purge_step: int | None = None):
        Event, SessionLog, _, RecordWriter = tensorboardx()
        stem = Path(run_dir) / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        self.path, n = stem, 0
        while self.path.exists():  # a resumed run within the same second: a file of its own
            n += 1
            self.path = stem.with_name(f"{stem.name}.{n}")
        self.file = RecordWriter(str(self.path))
        self.closed = False
        self._put(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:  # as tensorboardX's SummaryWriter(purge_step=...) marks it
            self._put(Event(step=purge_step, file_version="brain.Event:2"))
            self._put(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))
        self.flush()

    def _put(self, event) -> None:
        self.file.write(event.SerializeToString())

    def flush(self) -> None:
        self.file.flush()
        self.flushed = time.monotonic()

    def write(self, record: dict) -> None:
        Event, _, Summary, _ = tensorboardx()
        values = [Summary.Value(tag=tag, simple_value=float(record[key])) for key, tag in TAGS.items()
                  if record.get(key) is not None and not (key == "tokens_per_s" and "compile_s" in record)]
        if values:
            self._put(Event(wall_time=time.time(), step=int(record["step"]), summary=Summary(value=values)))
        if time.monotonic() - self.flushed >= self.FLUSH_S:
            self.flush()

    def close(self) -> None:
        """Flush and close the file; it is closed even when the flush fails (that OSError
        is raised once; a second call does nothing)."""
        if not self.closed:
            self.closed = True
            self.file.close()  # a Python file: closed even when its final flush fails


EVENT_GLOB = "events.out.tfevents.*"


def clear_event_files(run_dir) -> int:
    """Delete the event files in ``run_dir`` (left by an earlier run that wrote no
    checkpoint, so a fresh run's curves do not mix with them); returns how many."""
    paths = sorted(Path(run_dir).glob(EVENT_GLOB))
    for path in paths:
        path.unlink()
    return len(paths)


def open_event_log(run_dir, purge_step: int | None = None, log=None) -> EventLog | None:
    """An EventLog, or None (said once through ``log``) when tensorboardX is missing."""
    try:
        return EventLog(run_dir, purge_step)
    except ImportError:
        if log:
            log("tensorboard: tensorboardX is not installed (pip install tensorboardX); no event files")
        return None


def read_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from the run folder's event files, parsed from their
    TFRecord framing (length, crc, Event proto, crc) with tensorboardX's protobufs."""
    Event = tensorboardx()[0]
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(run_dir).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        i = 0
        while i + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            if event.file_version and event.step:  # a resumed run's purge: drop steps >= it
                out = {t: [(s, v) for s, v in vals if s < event.step] for t, vals in out.items()}
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((int(event.step), float(v.simple_value)))
    return out
