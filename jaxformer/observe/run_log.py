"""What a training call writes about itself as it goes: a metrics.jsonl line (and
TensorBoard scalars) per logged step on the first process, the progress bar, the
step clock (the compile step apart, steady tokens/s), and the plots at the end.

The step's metrics stay on the device until a record needs them: ``add`` keeps
them, ``fetch`` brings every pending step's to the host in one transfer. The bar counts
finished steps only: ``finished(step)`` waits until that step's metrics are ready (the loop
asks for the step before the one it just dispatched, so at most two are in flight), and a
fetch finishes every step it brings back.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import jax

from jaxformer.observe import flops, report, tb
from jaxformer.observe.metrics import (GRAD_PLOT_FILE, METRICS_FILE, PLOT_FILE, plot_grad_norms,
                                       plot_losses, read_metrics, truncate_metrics, write_record)
from jaxformer.observe.words import plural


def close_all(closers) -> Exception | None:
    """Call every closer in turn, also after one fails; returns the first error (None:
    all closed). A run's writers close this way on every way out of the run."""
    first = None
    for close in closers:
        try:
            close()
        except Exception as e:  # noqa: BLE001 - kept, and the other writers still close
            first = first or e
    return first


def first_non_finite_loss(fetched: list) -> tuple[int, dict] | None:
    """(step, metrics) of the first non-finite loss or gradient norm among the
    fetched (step, metrics) pairs; None when all are finite."""
    for s, m in fetched:
        if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
            return s, m
    return None


class RunLog:
    """The records of one training call in ``run_dir`` from step ``start`` on.

    settings: the run's TrainSettings (steps, batch_size, seq_len, dtype); config: its
    ModelConfig and n_devices its device count (for MFU); resumed: this call resumes
    the run (records after ``start`` are dropped, the first record is marked);
    main: this process writes the files; progress: show the bar; log: a function
    given human-readable lines (the compile time, the summary), or None."""

    def __init__(self, run_dir: Path, settings, config, n_devices: int, start: int, *,
                 resumed: bool, main: bool, progress: bool, log=None):
        self.run_dir, self.settings, self.config, self.n_devices = run_dir, settings, config, n_devices
        self.resumed, self.main = resumed, main
        # lines given to ``log`` while the bar shows clear it first and draw it again after
        self.log = (lambda line: self._write_line(log, line)) if log else None
        self.path = run_dir / METRICS_FILE
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
            if resumed:
                truncate_metrics(self.path, start)
            else:
                self._clear_leftovers()
        tokens_per_step = settings.batch_size * settings.seq_len
        # the products a step computes per token (a LoRA step: no dW of the frozen weights)
        self.flops_per_token = flops.flops_per_token(config, settings.seq_len, settings.lora())
        # the peak MFU divides by, found (on a CPU: measured once per machine) before the clock starts
        self.peak, source = flops.device_peak(dtype=flops.matmul_dtype(config, settings.dtype))
        if log:
            log(f"MFU against a peak of {self.peak / 1e9:,.0f} GFLOP/s per device ({source})"
                if self.peak else f"MFU: n/a ({source})")
        self.clock = report.StepClock(tokens_per_step)
        self.events = tb.open_event_log(run_dir, start + 1 if resumed else None, log) if main else None
        self.bar = report.Progress(start, settings.steps, progress and main)
        self.pending: list = []  # (step, metrics on the device) since the last fetch
        self.records: list[dict] = []  # the records written by this call
        self.tokens_per_step = tokens_per_step
        self.t_last, self.steps_since = time.perf_counter(), 0  # the interval of tokens_per_s

    def _clear_leftovers(self) -> None:
        """A fresh run in a folder without checkpoints (a killed run's): its metrics.jsonl
        and TensorBoard event files go, and the log says so."""
        old = []
        if self.path.exists():
            self.path.unlink()
            old.append(METRICS_FILE)
        n = tb.clear_event_files(self.run_dir)
        if n:
            old.append(plural(n, "TensorBoard event file"))
        if old and self.log:
            self.log(f"{self.run_dir} held no checkpoint; removed the earlier run's "
                     f"{' and '.join(old)}")

    def add(self, step: int, metrics: dict) -> None:
        """Step ``step`` was dispatched; its ``metrics`` are still on the device."""
        self.pending.append((step, metrics))
        self.steps_since += 1

    def _write_line(self, log, line: str) -> None:
        bar = getattr(self, "bar", None)  # None until __init__ opens it
        if bar is None:
            log(line)
            return
        with bar.writing():
            log(line)

    def finished(self, step: int) -> None:
        """Wait until step ``step``'s results are ready (on the device; nothing is copied); the
        bar then counts it and every step before it. A step not pending was fetched already."""
        waiting = [m for s, m in self.pending if s == step]
        if waiting:
            jax.block_until_ready(waiting[0])
        self.bar.finished(step)

    def fetch(self) -> list[tuple[int, dict]]:
        """The (step, metrics) pairs since the last fetch, brought to the host at once."""
        steps = [s for s, _ in self.pending]
        values = jax.device_get([m for _, m in self.pending])
        fetched = [(s, {k: float(v) for k, v in m.items()}) for s, m in zip(steps, values)]
        self.pending.clear()
        compile_s = self.clock.step_done(len(fetched))
        if compile_s is not None and self.log:
            self.log(report.compile_line(compile_s, fetched[0][0]))
        if fetched:
            self.bar.finished(fetched[-1][0])
        return fetched

    def record(self, step: int, host: dict) -> dict:
        """The record of ``step`` from its fetched metrics, with the training speed
        since the last record (the first record of a call carries compile_s instead of
        a steady speed, and ``resumed`` when the call resumed the run)."""
        now = time.perf_counter()
        record = {"step": step, **host,
                  "tokens_per_s": self.tokens_per_step * self.steps_since / max(now - self.t_last, 1e-9)}
        if not self.records:  # the first step of this call: its time is mostly compiling
            record["compile_s"] = self.clock.compile_s
        if self.resumed and not self.records:
            record["resumed"] = True
        return record

    def write(self, record: dict) -> None:
        """metrics.jsonl and TensorBoard get ``record``; the bar shows it. Not step time:
        the step clock is paused (steady tokens/s counts steps only)."""
        with self.clock.paused():
            if self.main:
                write_record(self.path, record)
                if self.events:
                    self.events.write(record)
            self.records.append(record)
            speed = ({} if "compile_s" in record else  # the first record's speed is the compile's
                     dict(tok_s=f"{record['tokens_per_s']:.0f}", mfu=self.mfu(record["tokens_per_s"])))
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", **speed)
            self.t_last, self.steps_since = time.perf_counter(), 0

    @contextlib.contextmanager
    def paused(self):
        """Time that is not training (validation, checkpoint writing): left out of the
        step clock and of tokens/s."""
        t0 = time.perf_counter()
        with self.clock.paused():
            yield
        self.t_last += time.perf_counter() - t0

    def mfu(self, tokens_per_s: float) -> str:
        """Model FLOPs utilization of ``tokens_per_s`` on this run's devices (flops.py)."""
        if not self.peak:
            return "n/a"
        return f"{100 * tokens_per_s * self.flops_per_token / (self.peak * self.n_devices):.1f}%"

    def close(self) -> None:
        """Close the bar and the event file, then plot every record of the run (all
        calls); each is tried even when one before it fails, and the first error is raised."""
        closers = [self.bar.close] + ([self.events.close] if self.events else [])
        if self.main:
            closers.append(self._plot)
        error = close_all(closers)
        if error is not None:
            raise error

    def _plot(self) -> None:
        all_records = read_metrics(self.run_dir)
        if all_records:
            plot_losses(all_records, self.run_dir / PLOT_FILE)
            plot_grad_norms(all_records, self.run_dir / GRAD_PLOT_FILE)

    def summary(self) -> dict:
        """The call's timing (report.StepClock.summary), also given to ``log`` in one line."""
        timing = self.clock.summary()
        if self.log:
            steady = timing.get("steady_tokens_per_s")
            self.log(report.summary_line(timing)
                     + (f"; steady-state MFU {self.mfu(steady)}" if steady else ""))
        return timing
