"""Stopping a run early, with every result kept.

``fedguard run`` answers SIGINT or SIGTERM by writing the signal's name into a stop file whose path it gives
the run in ``$FEDGUARD_STOP_FILE``; a SIGINT to Flower's simulation process (the way Flower's own stops reach
it) does the same through Flower's exit handlers. The ServerApp sees the request through a
``StopRequest``: its ``StoppableGrid`` ends the round in progress with ``RunInterrupted``, the attacker pool
stops waiting, and the run's ending records what was left as ``interrupted`` and writes the report.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from flwr.app import Message, RecordDict
from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=no-name-in-module
from flwr.serverapp import Grid
from flwr.supercore.exit import add_exit_handler
from flwr.supercore.run import Run

from fedguard.runtime.launcher import STOP_FILE_ENV

PULL_SECONDS = 0.1  # how often a round's replies are pulled, and the stop request looked at


class RunInterrupted(Exception):
    """The run was asked to stop before its end; the message says by what."""


class StopRequest:
    """Whether the run has been asked to stop, and why: the stop file exists (its text names the signal),
    or ``request`` was called."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._reason: str | None = None

    @classmethod
    def from_environment(cls) -> StopRequest:
        """The stop request of this run: the stop file ``fedguard run`` names in ``$FEDGUARD_STOP_FILE``; none
        but ``request`` when the run was started otherwise."""
        value = os.environ.get(STOP_FILE_ENV)
        return cls(Path(value) if value else None)

    def request(self, reason: str) -> None:
        """Ask the run to stop, saying why."""
        if self._reason is None:
            self._reason = reason

    def reason(self) -> str | None:
        """Why the run is to stop, or None while it goes on."""
        if self._reason is None and self.path is not None and self.path.exists():
            self._reason = f"stopped by {self.path.read_text().strip() or 'request'}"
        return self._reason

    def check(self) -> None:
        """Raise ``RunInterrupted`` once a stop has been requested."""
        reason = self.reason()
        if reason is not None:
            raise RunInterrupted(reason)


def stop_on_flower_exit(stop: StopRequest) -> None:
    """When Flower ends the simulation process (on SIGINT), request the stop, so that the run's ending runs
    while Flower exits. Not waited for here: Flower's handler runs on the main thread, which may hold what the
    run's ending needs."""
    add_exit_handler(
        lambda: stop.request("stopped by Flower (the simulation process was asked to exit)"), run_before_force_exit=True
    )


class StoppableGrid(Grid):
    """``grid`` whose waits end with ``RunInterrupted`` once ``stop`` is requested: the replies of a round
    and the node list (``wait_for_nodes``) are polled, and the request looked at between polls."""

    def __init__(self, grid: Grid, stop: StopRequest) -> None:
        self.grid = grid
        self.stop = stop

    def set_run(self, run: Run) -> None:
        self.grid.set_run(run)

    @property
    def run(self) -> Run:
        return self.grid.run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        self.stop.check()
        return self.grid.get_node_ids()

    def get_nodes(self) -> Iterable[NodeInfo]:
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        self.stop.check()
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages`` and pull their replies until all are in, ``timeout`` seconds pass, or the stop is
        requested (``RunInterrupted``)."""
        waiting = set(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while waiting and (deadline is None or time.monotonic() < deadline):
            self.stop.check()
            pulled = list(self.grid.pull_messages(waiting))
            replies += pulled
            waiting -= {reply.metadata.reply_to_message_id for reply in pulled}
            if waiting:
                time.sleep(PULL_SECONDS)
        return replies
