"""A run asked to stop while a plugin's code holds the ServerApp: which plugin, and where.

The ServerApp stops at its next call to the grid (``fedguard.runtime.stopping``); code of a ``server.plugins``
module that never returns (a strategy's ``aggregate_train`` that blocks) never gets there, and the run is then
stopped at once by ``fedguard run``. A watcher thread notes, ``STUCK_AFTER`` seconds after the stop was asked for,
the plugin line the ServerApp's thread is still running: it prints it and records the run ``interrupted`` with
the plugin named in ``status.json``, which the run's own ending overwrites should the run stop after all.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from pathlib import Path

from fedguard.plugin_faults import running_plugin
from fedguard.report.run_status import write_status
from fedguard.runtime.stopping import StopRequest

STUCK_AFTER = 5.0
"""Seconds after a stop request by which a ServerApp that is free to stop has (a round's pull loop looks every
0.1 s); fedguard run stops the run at once 30 s after the request (``STOP_GRACE``)."""
POLL_SECONDS = 0.5


def watch_for_stuck_plugin(
    stop: StopRequest, modules: list[str], folder: Path, rounds: Callable[[], int]
) -> threading.Event:
    """Start the watcher (module docstring) for the calling thread, the ServerApp's; returns the event to set
    when the run has ended, which ends the watcher. Nothing is started when no plugin is loaded."""
    ended = threading.Event()
    if not modules:
        return ended
    server = threading.get_ident()

    def watch() -> None:
        while stop.reason() is None:
            if ended.wait(POLL_SECONDS):
                return
        if ended.wait(STUCK_AFTER):
            return
        found = running_plugin(sys._current_frames().get(server), modules)
        if found is None:
            return
        reason = (
            f"{stop.reason()} while server.plugins module {found.module!r} was running (at {found}), which had not "
            f"returned {STUCK_AFTER:g} s after the stop was asked for"
        )
        print(f"fedguard: {reason}", flush=True)
        write_status(folder, "interrupted", rounds(), reason, found.module)

    threading.Thread(target=watch, name="fedguard-stuck-plugin", daemon=True).start()
    return ended
