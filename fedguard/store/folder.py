"""A run folder's files: every name in it, and the only ways fedguard writes and reads them.

A run folder (``runs/<name>``) holds::

    config.toml       the resolved configuration; passed back as a preset, it reproduces the run
    rounds.jsonl      one row per round
    attacks.jsonl     one row per attacked upload
    observations/     the captured uploads, round-RRRR_client-CCCC.npz
    vault/            the true batches behind them, under the same names
    images/           per scored upload <prefix>_truth.png and <prefix>_recon.png, and the
                      reconstruction's arrays <prefix>_recon.npz
    status.json       how the run ended
    run.lock          the process id of the ``fedguard run`` writing the folder, locked while it runs
    report.html       the page on the run
    comparison.png    every attack's first reconstruction beside the client's batch

A sweep folder holds ``sweep.jsonl`` (a row per cell), ``runs.jsonl`` (a row per run) and ``summary.md`` beside
its runs' folders.

Whole files (configuration, status, report, figures, grids, summaries) are written by ``write_atomic``: a
temporary file in the same folder, flushed and synced, then renamed over the old one, so a reader finds
the old file or the new one, never a part. Rows are added by ``JsonlAppender``: each row is one line
given to the system in one write on a descriptor opened for appending, so a killed run leaves at most a
torn last line. ``read_jsonl`` skips such a line with a warning and names the file and line of any other
line that is not a row.

Rows and JSON files are strict JSON (RFC 8259), which has no NaN or infinity. A float that is not finite
is written as ``null`` and named in the row's ``non_finite`` object, which maps the value's JSON Pointer
(RFC 6901) to ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``::

    {"round": 3, "accuracy": 0.1, "loss": null, "seconds": 2.1, "non_finite": {"/loss": "NaN"}}

``read_jsonl`` puts these floats back; any other JSON reader sees ``null`` where no number is known.

Files a row names (image grids) are opened only through ``inside``, which refuses a path that resolves
outside the run folder (absolute, through ``..``, or through a symbolic link out).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import warnings
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

CONFIG_FILE = "config.toml"
ROUNDS_FILE = "rounds.jsonl"
ATTACKS_FILE = "attacks.jsonl"
OBSERVATIONS_DIR = "observations"
VAULT_DIR = "vault"
CLIENT_STATE_DIR = "client-state"  # simulated clients' defense state, a folder per client (store.client_state)
CHECKPOINT_FILE = "checkpoint.npz"  # the global model and the strategy's state after the last completed round
IMAGES_DIR = "images"
STATUS_FILE = "status.json"
LOCK_FILE = "run.lock"  # held by the fedguard run writing the folder (fedguard.store.lock)
REPORT_FILE = "report.html"
COMPARISON_FILE = "comparison.png"
SWEEP_FILE = "sweep.jsonl"
RUNS_FILE = "runs.jsonl"
SUMMARY_FILE = "summary.md"
APP_FILE = "app.json"  # a Flower app fedguard audits (fedguard.flower.Audit): its strategy and nodes
UPLOAD_GLOB = "round-*_client-*.npz"  # observations and vault entries
GRID_KINDS = ("truth", "recon")
NON_FINITE_KEY = "non_finite"
RUNS_ENV = "FEDGUARD_RUNS"

Note = Callable[[str], None]


class RunFileError(ValueError):
    """A run-folder file that cannot be read as written, or a path that leads out of the run folder."""


class RunFolderWarning(UserWarning):
    """Something in a run folder was skipped (a torn last line, a refused path)."""


def warn(message: str) -> None:
    """The default ``Note``: a ``RunFolderWarning``."""
    warnings.warn(message, RunFolderWarning, stacklevel=2)


# ----------------------------------------------------------------------------------------------
# Names
# ----------------------------------------------------------------------------------------------


def runs_home() -> Path:
    """Where runs started by ``flwr run`` go when ``out-dir`` is empty or relative: ``$FEDGUARD_RUNS``, else
    ``~/fedguard-runs`` (the ServerApp's working directory is wherever Flower's SuperLink was started)."""
    return Path(os.environ.get(RUNS_ENV) or Path.home() / "fedguard-runs")


def flwr_run_dir(out_dir: str, name: str, run_id: int) -> Path:
    """The folder of Flower run ``run_id``: an absolute ``out_dir``; a relative one under ``runs_home()``;
    none, ``runs_home()/<name>-run-<run_id>``, which the simulated clients can compute as well."""
    if not out_dir:
        return runs_home() / f"{name}-run-{run_id}"
    out = Path(out_dir)
    return out if out.is_absolute() else runs_home() / out


def upload_stem(round_: int, client: int) -> str:
    """``round-RRRR_client-CCCC``: the upload of ``client`` in ``round_``."""
    return f"round-{round_:04d}_client-{client:04d}"


def upload_file_name(round_: int, client: int) -> str:
    """The file of one upload in ``observations/`` and in ``vault/``."""
    return f"{upload_stem(round_, client)}.npz"


def image_prefix(round_: int, client: int, label: str) -> str:
    """``images/<upload>_<label>``: where the grids of one attack on one upload go, relative to the run folder."""
    return f"{IMAGES_DIR}/{upload_stem(round_, client)}_{label}"


def grid_name(prefix: str, kind: str) -> str:
    """``<prefix>_<kind>.png``, ``kind`` one of ``GRID_KINDS``."""
    return f"{prefix}_{kind}.png"


def recon_name(prefix: str) -> str:
    """``<prefix>_recon.npz``: the reconstruction as arrays, ``images`` (N, C, H, W) float32 in [0, 1] in the
    order of the client's batch as scored, and ``labels`` (N,)."""
    return f"{prefix}_recon.npz"


def inside(run_dir: Path, name: str) -> Path:
    """``run_dir/name`` resolved; ``RunFileError`` when it lies outside ``run_dir`` (absolute, ``..``, a link out)."""
    root = Path(run_dir).resolve()
    path = (root / name).resolve()
    if not path.is_relative_to(root):
        raise RunFileError(f"{name} resolves outside the run folder {root}; refused")
    return path


# ----------------------------------------------------------------------------------------------
# Strict JSON
# ----------------------------------------------------------------------------------------------


def _pointer_token(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


def _finite(value: Any, pointer: str, found: dict[str, str]) -> Any:
    """``value`` with every non-finite float replaced by None; ``found`` gets pointer -> its name."""
    if isinstance(value, float) and not math.isfinite(value):
        found[pointer] = "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
        return None
    if isinstance(value, dict):
        return {key: _finite(item, f"{pointer}/{_pointer_token(key)}", found) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item, f"{pointer}/{index}", found) for index, item in enumerate(value)]
    return value


def encode_row(row: dict[str, Any]) -> str:
    """``row`` as one line of strict JSON; non-finite floats become null, named under ``non_finite``."""
    found: dict[str, str] = {}
    clean = _finite(row, "", found)
    if found:
        clean[NON_FINITE_KEY] = found
    return json.dumps(clean, allow_nan=False)


def _restore(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with the floats its ``non_finite`` object names put back."""
    for pointer, name in row.pop(NON_FINITE_KEY, {}).items():
        *path, last = [token.replace("~1", "/").replace("~0", "~") for token in pointer.split("/")[1:]]
        node: Any = row
        for token in path:
            node = node[int(token)] if isinstance(node, list) else node[token]
        node[int(last) if isinstance(node, list) else last] = float(name)
    return row


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def write_atomic(path: Path, data: bytes | str) -> Path:
    """Write ``data`` (text as UTF-8) to ``path``: a temporary file in the same folder, flushed and synced,
    then ``os.replace``; creates the folder. A failure leaves the previous file (or none) and no temporary."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(temp, "xb") as out:
            out.write(data.encode("utf-8") if isinstance(data, str) else data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return path


def write_json(path: Path, value: dict[str, Any]) -> Path:
    """``value`` as a strict JSON file, atomically."""
    return write_atomic(path, encode_row(value) + "\n")


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    """``rows`` as a whole ``.jsonl`` file of strict JSON lines, atomically."""
    return write_atomic(path, "".join(encode_row(row) + "\n" for row in rows))


def _is_row(line: bytes) -> bool:
    try:
        _parse(line)
    except _UNREADABLE:
        return False
    return True


class JsonlAppender:
    """Appends rows to a ``.jsonl`` file, each as one write of one line (no buffer to flush).

    Opening mends what a killed writer left: a last row missing only its newline gets it, a torn last
    line is cut off with a warning, so the next row starts a line of its own.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            self._mend_tail()
        except BaseException:
            os.close(self._fd)
            raise

    def _mend_tail(self) -> None:
        size = os.fstat(self._fd).st_size
        if size == 0 or os.pread(self._fd, 1, size - 1) == b"\n":
            return
        content = os.pread(self._fd, size, 0)
        start = content.rfind(b"\n") + 1
        if _is_row(content[start:]):
            os.write(self._fd, b"\n")
            return
        os.ftruncate(self._fd, start)
        warn(f"{self.path}: cut a torn last line ({size - start} bytes) before appending")

    def append(self, row: dict[str, Any]) -> None:
        """Write ``row`` as one strict JSON line."""
        data = (encode_row(row) + "\n").encode("utf-8")
        while data:  # a regular file takes it in one write; the loop only finishes a short one
            data = data[os.write(self._fd, data) :]

    def close(self) -> None:
        """Close the file."""
        os.close(self._fd)

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------

_UNREADABLE = (ValueError, KeyError, IndexError, TypeError, AttributeError)


def _parse(data: bytes) -> dict[str, Any]:
    """One JSON object with its non-finite floats put back; an error from ``_UNREADABLE`` when it is not one."""
    row = json.loads(data.decode("utf-8"))
    if not isinstance(row, dict):
        raise ValueError(f"a JSON {type(row).__name__}, not an object")
    return _restore(row)


def _row(path: Path, number: int, line: bytes) -> dict[str, Any]:
    """Line ``number`` of ``path`` as a row; ``RunFileError`` naming both when it is not one."""
    try:
        return _parse(line)
    except _UNREADABLE as error:
        raise RunFileError(f"{path}, line {number}: not a row ({error})") from None


def read_jsonl(path: Path, note: Note = warn) -> list[dict[str, Any]]:
    """The rows of ``path``, a missing file none; blank lines are skipped.

    A last line without its newline that is not a row is what a stopped writer leaves: it is skipped and
    ``note`` told. Any other line that is not a row raises ``RunFileError`` with the file and line.
    """
    path = Path(path)
    if not path.is_file():
        return []
    *lines, tail = path.read_bytes().split(b"\n")
    rows = [_row(path, number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if tail.strip():
        try:
            rows.append(_row(path, len(lines) + 1, tail))
        except RunFileError:
            note(f"{path}: skipped the torn last line {len(lines) + 1} ({len(tail)} bytes, no newline)")
    return rows


def read_json(path: Path) -> dict[str, Any] | None:
    """The object in the JSON file ``path`` (non-finite floats put back), or None when there is none."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return _parse(path.read_bytes())
    except _UNREADABLE as error:
        raise RunFileError(f"{path}: not a JSON object ({error})") from None
