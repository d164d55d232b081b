"""Batches made ahead of the step: a background thread computes ``make(index)`` for
index, index + 1, ... up to ``depth`` ahead, so the step does not wait on the host
(reading shards, gathering windows). The batches are those ``make`` gives, in order:
prefetching changes when they are made, never which."""

from __future__ import annotations

import queue
import threading
from typing import Callable


class Prefetcher:
    """``next()`` returns make(start), make(start + 1), ...; ``close()`` stops the thread.
    An exception raised by ``make`` is raised again by the ``next()`` that reaches it."""

    def __init__(self, make: Callable[[int], dict], start: int, depth: int = 2):
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth!r}")
        self._make, self._queue, self._stop = make, queue.Queue(maxsize=depth), threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(start,), daemon=True,
                                        name="batch-prefetch")
        self._thread.start()

    def _fill(self, index: int) -> None:
        while not self._stop.is_set():
            try:
                item = (self._make(index), None)
            except BaseException as e:  # handed to the consumer
                item = (None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[1] is not None:
                return
            index += 1

    def next(self) -> dict:
        batch, error = self._queue.get()
        if error is not None:
            raise error
        return batch

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
