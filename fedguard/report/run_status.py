"""``status.json``: how a run ended, written by the ServerApp when it stops.

``{"status": "completed" | "failed" | "interrupted", "error": "<why>", "rounds": <rounds finished>}``
('interrupted': stopped on request, e.g. ``fedguard run`` given SIGINT or SIGTERM); written atomically, so
a reader sees the whole file or none (a run still going, or killed, has none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedguard.store.folder import STATUS_FILE, read_json, write_json


def write_status(folder: Path, status: str, rounds: int, error: str = "") -> Path:
    """Write the run's ending into ``folder/status.json``."""
    return write_json(
        Path(folder) / STATUS_FILE, {"status": status, "rounds": rounds, **({"error": error} if error else {})}
    )


def read_status(folder: Path) -> dict[str, Any] | None:
    """The run's ending, or None when it has not written one."""
    return read_json(Path(folder) / STATUS_FILE)
