"""What a sweep ran as: the preset (its path and the SHA-256 of its bytes) and every ``--only``, ``--seeds`` and
``--set``, kept in the sweep folder's ``invocation.json`` and shown atop ``summary.md`` and ``sweep.html``."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

INVOCATION_FILE = "invocation.json"  # the sweep folder's record of the preset and the options it ran with


def invocation(
    path: Path, only: list[str] | tuple[str, ...], seeds: list[int] | None, overrides: list[str] | tuple[str, ...]
) -> dict[str, Any]:
    """The preset (its path and the SHA-256 of its bytes) and every ``--only``, ``--seeds`` and ``--set``."""
    return {
        "preset": str(path),
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "only": list(only),
        "seeds": None if seeds is None else list(seeds),
        "overrides": list(overrides),
    }


def invocation_line(record: dict[str, Any]) -> str:
    """One line of Markdown: the command that ran, with the preset's digest."""
    words = ["fedguard sweep", record["preset"]]
    words += [f"--only {name}" for name in record.get("only") or []]
    if record.get("seeds") is not None:
        words.append("--seeds " + ",".join(map(str, record["seeds"])))
    words += [f"--set {text}" for text in record.get("overrides") or []]
    return f"Run as `{' '.join(words)}` (preset SHA-256 `{record['sha256'][:12]}`).\n"
