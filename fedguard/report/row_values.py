"""The rows the report reads, each value checked: one of the wrong type (a ``psnr`` of ``"high"``, a ``floor`` that
is a list) is named with its file and row and left out (``None``, drawn as a dash), so a bad value costs its own
figure and nothing else of the report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedguard.limits import shown
from fedguard.store.folder import ATTACKS_FILE, ROUNDS_FILE, Note, read_jsonl

NUMBER, TEXT, TABLE = "a number", "a string", "an object"
FIELDS: dict[str, dict[str, str]] = {
    ROUNDS_FILE: {"round": NUMBER, "accuracy": NUMBER, "loss": NUMBER, "seconds": NUMBER},
    ATTACKS_FILE: {
        "round": NUMBER,
        "client": NUMBER,
        "batch_size": NUMBER,
        "psnr": NUMBER,
        "ssim": NUMBER,
        "lpips": NUMBER,
        "mse": NUMBER,
        "label_accuracy": NUMBER,
        "seconds": NUMBER,
        "leaked_images": NUMBER,
        "best_ssim": NUMBER,
        "attack": TEXT,
        "defense": TEXT,
        "status": TEXT,
        "images": TEXT,
        "error": TEXT,
        "manipulation": TEXT,
        "floor": TABLE,
    },
}
"""The fields the report reads of each file's rows, by what each must be when present and not null."""
FLOOR: dict[str, str] = {"psnr": NUMBER, "ssim": NUMBER}
"""The fields of an attack row's ``floor``."""


def _fits(value: Any, kind: str) -> bool:
    if value is None:
        return True
    if kind == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str if kind == TEXT else dict)


def _checked(row: dict[str, Any], fields: dict[str, str], where: str, note: Note) -> dict[str, Any]:
    """``row`` with each of ``fields`` that is not what it must be set to None, each noted (``where``: the file and
    row, and the table's name)."""
    clean = dict(row)
    for key, kind in fields.items():
        if not _fits(row.get(key), kind):
            note(f"{where}{key} = {shown(row[key])} is not {kind}; left out")
            clean[key] = None
        elif kind == TABLE and row.get(key) is not None:
            clean[key] = _checked(row[key], FLOOR, f"{where}{key}.", note)
    return clean


def read_rows(run_dir: Path, name: str, note: Note) -> list[dict[str, Any]]:
    """The rows of ``run_dir/name`` (``rounds.jsonl`` or ``attacks.jsonl``, read by ``read_jsonl``), each value
    the report reads checked; ``note`` hears of each left out."""
    path = Path(run_dir) / name
    return [
        _checked(row, FIELDS[name], f"{path}, row {index}: ", note)
        for index, row in enumerate(read_jsonl(path, note), 1)
    ]
