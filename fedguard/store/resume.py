"""Continuing a stopped run from its last completed round (``fedguard run --resume RUN_DIR``).

The run folder is rewound to the checkpoint (``fedguard.store.checkpoint``): every row, upload, image and client
state of a later round (a round that never completed) is removed, so that the rounds run again exactly as
they first would have. Everything of the rounds up to the checkpoint is kept.
"""

from __future__ import annotations

import re
from pathlib import Path

from fedguard.store.checkpoint import RoundCheckpoint, read_checkpoint
from fedguard.store.client_state import discard_after
from fedguard.store.folder import (
    ATTACKS_FILE,
    CLIENT_STATE_DIR,
    IMAGES_DIR,
    OBSERVATIONS_DIR,
    ROUNDS_FILE,
    VAULT_DIR,
    read_jsonl,
    write_jsonl,
)

_UPLOAD_ROUND = re.compile(r"round-(\d+)_client-\d+")


def _later_uploads(folder: Path, round_: int) -> list[Path]:
    """Files in ``folder`` named for an upload of a round after ``round_``."""
    if not folder.is_dir():
        return []
    return [p for p in folder.iterdir() if (m := _UPLOAD_ROUND.match(p.name)) and int(m.group(1)) > round_]


def _keep_rows(path: Path, round_: int) -> int:
    """Rewrite ``path`` without the rows of rounds after ``round_``; returns how many went."""
    if not path.is_file():
        return 0
    rows = read_jsonl(path)
    kept = [row for row in rows if int(row.get("round", 0)) <= round_]
    if len(kept) != len(rows) or not _ends_a_line(path):
        write_jsonl(path, kept)
    return len(rows) - len(kept)


def _ends_a_line(path: Path) -> bool:
    """Whether ``path`` is empty or its last byte is a newline (read alone)."""
    with path.open("rb") as handle:
        handle.seek(0, 2)
        if handle.tell() == 0:
            return True
        handle.seek(-1, 2)
        return handle.read(1) == b"\n"


def rewind(folder: Path, round_: int) -> dict[str, int]:
    """Remove from the run in ``folder`` what rounds after ``round_`` left; returns what went, by kind."""
    folder = Path(folder)
    removed = {
        "round rows": _keep_rows(folder / ROUNDS_FILE, round_),
        "attack rows": _keep_rows(folder / ATTACKS_FILE, round_),
    }
    for kind, sub in (("uploads", OBSERVATIONS_DIR), ("true batches", VAULT_DIR), ("images", IMAGES_DIR)):
        later = _later_uploads(folder / sub, round_)
        for path in later:
            path.unlink(missing_ok=True)
        removed[kind] = len(later)
    removed["client states"] = discard_after(folder / CLIENT_STATE_DIR, round_)
    return removed


def resume_point(folder: Path, total_rounds: int) -> RoundCheckpoint:
    """The checkpoint the run in ``folder`` resumes from; ``ValueError`` when there is nothing left to run."""
    checkpoint = read_checkpoint(folder)
    if checkpoint.round >= total_rounds:
        raise ValueError(
            f"{folder}: the run completed all {total_rounds} rounds (checkpoint at round "
            f"{checkpoint.round}); to run more, resume with --set train.rounds=<more>"
        )
    return checkpoint
