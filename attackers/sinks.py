"""Where captured observations go: the server hands them over and returns at once."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Protocol

from fedguard.observation import Observation

log = logging.getLogger(__name__)


class ObservationSink(Protocol):
    """Receives captured uploads. ``submit`` must not block training."""

    def submit(self, obs: Observation) -> None: ...

    def close(self, timeout: float | None = None) -> None: ...


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
