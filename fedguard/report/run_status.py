"""``status.json``: how a run ended, written by the ServerApp when it stops.

``{"status": "completed" | "failed" | "interrupted", "error": "<why>", "rounds": <rounds finished>}``
('interrupted': stopped on request, e.g. ``fedguard run`` given SIGINT or SIGTERM; ``"plugin": "<module>"`` added
when a ``server.plugins`` module's code raised or exited and stopped the run); written atomically, so
a reader sees the whole file or none (a run still going, or killed, has none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedguard.store.folder import STATUS_FILE, read_json, write_json


def write_status(folder: Path, status: str, rounds: int, error: str = "", plugin: str = "") -> Path:
    """Write the run's ending into ``folder/status.json`` (``plugin``: the ``server.plugins`` module whose code
    stopped the run, if one did)."""
    ending: dict[str, Any] = {"status": status, "rounds": rounds}
    if error:
        ending["error"] = error
    if plugin:
        ending["plugin"] = plugin
    return write_json(Path(folder) / STATUS_FILE, ending)


def read_status(folder: Path) -> dict[str, Any] | None:
    """The run's ending, or None when it has not written one."""
    return read_json(Path(folder) / STATUS_FILE)
