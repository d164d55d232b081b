"""TensorBoard event files in the run folder, next to metrics.jsonl.

Written with tensorboardX (no TensorFlow needed); ``tensorboard --logdir RUN``
shows them. Each metrics record becomes scalars at its step:

  train/loss, train/grad_norm, train/lr (train/muon_lr), train/tokens_per_s (steady-state
  intervals only: the record that carries compile_s is left out),
  val/loss, val/bits_per_byte or val/bits_per_char, run/resumed (1 where a run
  was resumed).
"""

from __future__ import annotations

import struct
from pathlib import Path

TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "lr": "train/lr",
        "muon_lr": "train/muon_lr",
        "tokens_per_s": "train/tokens_per_s", "val_loss": "val/loss",
        "val_bits_per_byte": "val/bits_per_byte", "val_bits_per_char": "val/bits_per_char",
        "resumed": "run/resumed"}


class EventLog:
    """A tensorboardX writer on ``run_dir``; ``purge_step`` drops events at or after
    that step left by an interrupted run (a resumed run writes them again)."""

    def __init__(self, run_dir, purge_step: int | None = None):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(Path(run_dir)), purge_step=purge_step,
                                    flush_secs=30)

    def write(self, record: dict) -> None:
        step = int(record["step"])
        for key, tag in TAGS.items():
            value = record.get(key)
            if value is None or (key == "tokens_per_s" and "compile_s" in record):
                continue
            self.writer.add_scalar(tag, float(value), step)

    def close(self) -> None:
        self.writer.close()


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
    from tensorboardX.proto.event_pb2 import Event

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
