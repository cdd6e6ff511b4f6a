"""Where captured observations go: the server hands them over and returns at once."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from fedguard.observation import Observation, save_observation
from fedguard.store.folder import RunFileUnwritable

log = logging.getLogger(__name__)


class ObservationSink(Protocol):
    """Receives captured uploads. ``submit`` must not block training."""

    def submit(self, obs: Observation) -> None: ...

    def close(self, timeout: float | None = None) -> None: ...


class DiskSink:
    """Saves observations to ``folder`` on a background thread (see ``fedguard.observation``)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.saved: list[Path] = []
        self.failed: list[tuple[str, str]] = []
        self.full: RunFileUnwritable | None = None  # the first write that found the disk full
        self._queue: queue.Queue[Observation | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="observation-writer", daemon=True)
        self._thread.start()

    def submit(self, obs: Observation) -> None:
        """Queue ``obs`` for writing; returns immediately. Once a write found the disk full, raises its
        ``RunFileUnwritable``: the run stops rather than go on capturing what it cannot keep."""
        if self.full is not None:
            raise self.full
        self._queue.put(obs)

    def close(self, timeout: float | None = None) -> None:
        """Write everything queued, then stop the writer (waits up to ``timeout`` seconds, any length)."""
        self._queue.put(None)
        self._thread.join(None if timeout is None else min(timeout, threading.TIMEOUT_MAX))
        if self._thread.is_alive():
            log.warning("observation writer still busy after %s s; %d left", timeout, self._queue.qsize())

    def _work(self) -> None:
        while (obs := self._queue.get()) is not None:
            try:
                self.saved.append(save_observation(obs, self.folder))
            except OSError as error:
                self.failed.append((obs.file_name, str(error)))
                log.error("could not save %s: %s", obs.file_name, error)
                if isinstance(error, RunFileUnwritable) and self.full is None:
                    self.full = error


class FanOut:
    """Hands every observation to several sinks (e.g. the disk and the attacker pool)."""

    def __init__(self, sinks: list[ObservationSink]) -> None:
        self.sinks = sinks

    def submit(self, obs: Observation) -> None:
        for sink in self.sinks:
            sink.submit(obs)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Each sink's ``held`` block (a sink without one is not held) around the block."""
        with contextlib.ExitStack() as stack:
            for sink in self.sinks:
                stack.enter_context(held(sink))
            yield

    def close(self, timeout: float | None = None) -> None:
        """Close each sink in order, all within ``timeout`` seconds together."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for sink in self.sinks:
            sink.close(None if deadline is None else max(0.0, deadline - time.monotonic()))


def held(sink: ObservationSink) -> contextlib.AbstractContextManager[None]:
    """``sink.held()`` where the sink has one (it acts on the block's observations as on one batch), else nothing."""
    hold = getattr(sink, "held", None)
    return hold() if callable(hold) else contextlib.nullcontext()
