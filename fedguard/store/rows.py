"""The rows a run folder holds, typed, and the one reader of each file.

``rounds.jsonl`` holds a ``RoundRow`` per round, ``attacks.jsonl`` an ``AttackRow`` per attacked upload and attack;
a sweep's ``runs.jsonl`` a ``CellRow`` per run and ``sweep.jsonl`` one per (setting, variant) cell. The types
name every field fedguard writes (each optional: a row of an older run may lack one, a failed row holds fewer);
``read_rounds``, ``read_attacks`` and ``read_cells`` are the readers, over ``fedguard.store.folder.read_jsonl``
(strict JSON, a torn last line skipped). The run readers also check each value the report and the sweep use: one
of the wrong type (a ``psnr`` of ``"high"``, a ``floor`` that is a list) is named with its file and row and left
out (``None``), so a bad value costs its own figure and nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypedDict, cast

from fedguard.limits import shown
from fedguard.store.folder import ATTACKS_FILE, ROUNDS_FILE, RUNS_FILE, SWEEP_FILE, Note, read_jsonl, warn


class RoundRow(TypedDict, total=False):
    """One round of ``rounds.jsonl`` (round 0: the initial model's evaluation)."""

    round: int
    accuracy: float | None
    loss: float | None
    seconds: float
    at: float  # when the row was written: seconds since the epoch (UTC)
    non_finite: dict[str, str]  # JSON Pointer -> the value written as null ('NaN', 'Infinity', ...)
    defense: dict[str, float]  # the defense's reports: largest running totals, means of per-upload numbers
    uploads: list[dict[str, Any]]  # per upload: its client and its per-upload reports
    upload_bytes: int  # mean bytes uploaded per client, as sent
    dense_bytes: int  # the same, dense
    clients: int
    failures: int
    failed: list[dict[str, Any]]  # {client, node, reason}: each client whose round failed
    stragglers: list[int]  # the clients that sent no reply within server.round-timeout
    rejected: list[dict[str, Any]]  # {client, reason}
    detect: list[dict[str, Any]]  # per client: its detectors' findings (fedguard.detect.Verdict.row)
    declined: int
    skipped: str
    stopped: str


class Floor(TypedDict, total=False):
    """The scores of the flat image (each true image's mean colour) against the truth: what no attack beats."""

    psnr: float | None
    ssim: float | None
    lpips: float | None


class AttackRow(TypedDict, total=False):
    """One attack on one captured upload in ``attacks.jsonl``: where the upload came from, the attack and its
    context (``fedguard.evaluation.Evaluator``), its status, and its scores against the vault's truth."""

    round: int
    client: int
    attack: str
    invocation: str  # fedguard.store.invocations: 'run', or the 'fedguard attack' that wrote the row
    source: str
    defense: str
    params: dict[str, Any]
    seed: int
    manipulation: str
    batch_size: int
    status: str
    error: str | None
    seconds: float
    at: float  # when the row was written: seconds since the epoch (UTC)
    mse: float | None
    psnr: float | None  # dB
    ssim: float | None
    lpips: float | None
    label_accuracy: float | None
    images: str | None  # the grids' file prefix
    stats: dict[str, Any]
    lpips_error: str | None
    per_image: list[dict[str, Any]]  # one score dict per true image, matched to its reconstruction
    leaked_images: int
    best_ssim: float
    floor: Floor
    gradient: dict[str, Any]
    non_finite: dict[str, str]


class CellRow(TypedDict, total=False):
    """One run of a sweep (``runs.jsonl``) or one (setting, variant) cell over its seeds (``sweep.jsonl``;
    ``fedguard.commands.sweep.summarize_runs``)."""

    setting: str
    variant: str
    seed: int
    seeds: list[int]
    failed_seeds: list[int]
    defense: str
    status: str
    error: str
    log: str
    folder: str
    setting_kind: str
    threat: str
    baseline: str
    rounds: int
    accuracy: float | None
    accuracy_ci95: list[float] | None
    accuracy_share: float | None
    seconds_per_round: float | None
    defense_report: dict[str, Any]
    epsilon: float | None
    raw_fraction: float
    attacked_uploads: int
    raw_attacked: int
    upload_share: float | None
    attacks: dict[str, dict[str, Any]]  # per attack: means over its scored rows (``attack_scores``)
    by_round: dict[str, dict[str, Any]]  # the strongest attack's scores per round
    strongest_attack: str | None
    psnr: float | None
    ssim: float | None
    lpips: float | None
    floor_psnr: float | None
    uploads: int
    images: int
    leaked_images: int
    privacy: dict[str, Any] | None  # fedguard.report.leakage.privacy


NUMBER, TEXT, TABLE = "a number", "a string", "an object"
CHECKED: dict[str, dict[str, str]] = {
    ROUNDS_FILE: {"round": NUMBER, "accuracy": NUMBER, "loss": NUMBER, "seconds": NUMBER, "at": NUMBER},
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
        "at": NUMBER,
        "leaked_images": NUMBER,
        "best_ssim": NUMBER,
        "attack": TEXT,
        "invocation": TEXT,
        "defense": TEXT,
        "status": TEXT,
        "images": TEXT,
        "error": TEXT,
        "manipulation": TEXT,
        "floor": TABLE,
    },
}
"""The fields checked in each file's rows, by what each must be when present and not null."""
FLOOR_CHECKED: dict[str, str] = {"psnr": NUMBER, "ssim": NUMBER}
"""The fields checked of an attack row's ``floor``."""


def read_rounds(folder: Path, note: Note = warn) -> list[RoundRow]:
    """The rows of ``folder``'s ``rounds.jsonl``, checked; ``note`` hears of each value left out."""
    return cast(list[RoundRow], _read_checked(Path(folder), ROUNDS_FILE, note))


def read_attacks(folder: Path, note: Note = warn) -> list[AttackRow]:
    """The rows of ``folder``'s ``attacks.jsonl``, checked; ``note`` hears of each value left out."""
    return cast(list[AttackRow], _read_checked(Path(folder), ATTACKS_FILE, note))


def read_cells(folder: Path, name: str = SWEEP_FILE, note: Note = warn) -> list[CellRow]:
    """The rows of a sweep folder's ``sweep.jsonl`` (``name`` = ``RUNS_FILE``: its ``runs.jsonl``)."""
    if name not in (SWEEP_FILE, RUNS_FILE):
        raise ValueError(f"{name!r}: a sweep folder's rows are {SWEEP_FILE!r} or {RUNS_FILE!r}")
    return cast(list[CellRow], read_jsonl(Path(folder) / name, note))


def _read_checked(folder: Path, name: str, note: Note) -> list[dict[str, Any]]:
    path = folder / name
    return [
        _checked(row, CHECKED[name], f"{path}, row {index}: ", note)
        for index, row in enumerate(read_jsonl(path, note), 1)
    ]


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
            clean[key] = _checked(row[key], FLOOR_CHECKED, f"{where}{key}.", note)
    return clean


def busy_span(folder: Path) -> tuple[float, float] | None:
    """When a run's rounds and attacks began and ended (seconds since the epoch, from its rows' ``at``): from the
    start of round 0, the initial evaluation (its row's ``at`` less its ``seconds``), to the last round or attack
    row written; None for a run without rows that carry ``at``."""
    rounds = [row for row in read_rounds(folder) if "at" in row]
    if not rounds:
        return None
    attacks = [row for row in read_attacks(folder) if "at" in row]
    first = min(rounds, key=lambda row: row["round"])
    return first["at"] - first["seconds"], max(row["at"] for row in [*rounds, *attacks])
