"""``status.json``: how a run ended, written by the ServerApp when it stops.

``{"status": "completed" | "failed", "error": "<why>", "rounds": <rounds finished>}``; written atomically, so
a reader sees the whole file or none (a run still going, or killed, has none).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

STATUS_FILE = "status.json"


def write_status(folder: Path, status: str, rounds: int, error: str = "") -> Path:
    """Write the run's ending into ``folder/status.json``."""
    path = Path(folder) / STATUS_FILE
    partial = path.with_name(f".{path.name}.part")
    partial.write_text(json.dumps({"status": status, "rounds": rounds, **({"error": error} if error else {})}))
    os.replace(partial, path)
    return path


def read_status(folder: Path) -> dict[str, Any] | None:
    """The run's ending, or None when it has not written one."""
    path = Path(folder) / STATUS_FILE
    return json.loads(path.read_text()) if path.is_file() else None
