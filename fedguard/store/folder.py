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
line that is not a row; it reads line by line and refuses a line longer than ``fedguard.limits.MAX_LINE_BYTES``
(naming its file, line and size) without holding it. A write that fails because the disk is full, the quota spent,
the file system read-only or the file over ``RLIMIT_FSIZE`` (``UNWRITABLE``) raises ``RunFileUnwritable``, naming
the file and the space left, and leaves the file as it was: the old whole file, or the rows before the failed one.

Rows and JSON files are strict JSON (RFC 8259), which has no NaN or infinity. A float that is not finite
is written as ``null`` and named in the row's ``non_finite`` object, which maps the value's JSON Pointer
(RFC 6901) to ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``::

    {"round": 3, "accuracy": 0.1, "loss": null, "seconds": 2.1, "non_finite": {"/loss": "NaN"}}

``read_jsonl`` puts these floats back; any other JSON reader sees ``null`` where no number is known.

Files a row names (image grids) are opened only through ``inside``, which refuses a path that resolves
outside the run folder (absolute, through ``..``, or through a symbolic link out).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

from fedguard import atomic, limits, run_owner

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
_HELD = 2**20  # bytes of a line read at once: a longer line is measured before it is read whole

Note = Callable[[str], None]


class RunFileError(ValueError):
    """A run-folder file that cannot be read as written, or a path that leads out of the run folder."""


UNWRITABLE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})
"""Why a run file cannot be written that no retry mends: the disk is full, the quota spent, the file system read-only,
or the file over the process's size limit (``RLIMIT_FSIZE``)."""


class RunFileUnwritable(OSError):
    """A run file that could not be written for one of ``UNWRITABLE``: names the file and the space left."""

    def __init__(self, path: Path, error: OSError) -> None:
        super().__init__(error.errno, error.strerror, str(path))
        self.free = _free_bytes(Path(path).parent)

    def __str__(self) -> str:
        free = "unknown" if self.free is None else f"{self.free} bytes ({self.free / 2**20:.1f} MiB)"
        return f"cannot write {self.filename}: {self.strerror}; free space on its file system: {free}"


def _free_bytes(folder: Path) -> int | None:
    """Bytes free to this process on the file system of ``folder`` (or of its nearest existing parent)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def unwritable(path: Path, error: OSError) -> OSError:
    """``error``, raised writing ``path``, as a ``RunFileUnwritable`` when it is one of ``UNWRITABLE``."""
    return RunFileUnwritable(path, error) if error.errno in UNWRITABLE else error


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


@contextlib.contextmanager
def replacing(path: Path, sync: bool = True) -> Iterator[BinaryIO]:
    """``fedguard.atomic.replacing`` for a run file: a temporary in the same folder that replaces ``path`` when
    the block ends; a failure leaves the previous file (or none) and no temporary; a full disk (``UNWRITABLE``)
    raises ``RunFileUnwritable`` naming ``path``."""
    try:
        with atomic.replacing(path, sync) as out:
            yield out
    except OSError as error:
        raise unwritable(Path(path), error) from error


def write_atomic(path: Path, data: bytes | str) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` through ``replacing``: the old file or the new, never a part."""
    with replacing(path) as out:
        out.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


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


def _last_line_start(fd: int, size: int) -> int:
    """The offset after the last newline in the first ``size`` bytes of the file open as ``fd`` (0: none), read
    backwards ``_HELD`` bytes at a time."""
    end = size
    while end > 0:
        start = max(0, end - _HELD)
        at = os.pread(fd, end - start, start).rfind(b"\n")
        if at >= 0:
            return start + at + 1
        end = start
    return 0


class JsonlAppender:
    """Appends rows to a ``.jsonl`` file, each as one write of one line (no buffer to flush); none once the run's
    owner died (``fedguard.run_owner``).

    Opening mends what a killed writer left: a last row missing only its newline gets it, a torn last
    line is cut off with a warning, so the next row starts a line of its own.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as error:
            raise unwritable(self.path, error) from error
        try:
            self._mend_tail()
        except OSError as error:
            os.close(self._fd)
            raise unwritable(self.path, error) from error
        except BaseException:
            os.close(self._fd)
            raise

    def _mend_tail(self) -> None:
        size = os.fstat(self._fd).st_size
        if size == 0 or os.pread(self._fd, 1, size - 1) == b"\n":
            return
        start = _last_line_start(self._fd, size)
        if size - start <= limits.MAX_LINE_BYTES and _is_row(os.pread(self._fd, size - start, start)):
            os.write(self._fd, b"\n")
            return
        os.ftruncate(self._fd, start)
        warn(f"{self.path}: cut a torn last line ({size - start} bytes) before appending")

    def append(self, row: dict[str, Any]) -> None:
        """Write ``row`` as one strict JSON line. A write that fails (a full disk: ``RunFileUnwritable``) takes
        back what it wrote of the line, so the file holds whole rows only."""
        data = (encode_row(row) + "\n").encode("utf-8")
        if run_owner.gone():  # the run's fedguard run died: its watcher is stopping this process
            run_owner.stop_here()
        end = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            while data:  # a regular file takes it in one write; the loop only finishes a short one
                data = data[os.write(self._fd, data) :]
        except OSError as error:
            with contextlib.suppress(OSError):  # truncating frees space; a read-only file system keeps no part
                os.ftruncate(self._fd, end)
            raise unwritable(self.path, error) from error

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


def _lines(path: Path, handle: BinaryIO) -> Iterator[tuple[int, bytes, bool]]:
    """(number, the line without its newline, whether a newline ended it) of each line of ``handle`` (opened
    on ``path``). A line longer than ``_HELD`` is measured first, reading on to its newline without holding it,
    and read again only when it is within ``limits.MAX_LINE_BYTES``; a longer one raises ``RunFileError`` naming
    the file, the line and its size, having held at most ``_HELD`` bytes of it."""
    number = 0
    while piece := handle.readline(_HELD):
        number += 1
        if piece.endswith(b"\n"):
            yield number, piece[:-1], True
            continue
        start, size, ended = handle.tell() - len(piece), len(piece), False
        while not ended and (more := handle.readline(_HELD)):
            size, ended = size + len(more), more.endswith(b"\n")
        length = size - ended
        if length > limits.MAX_LINE_BYTES:
            raise RunFileError(
                f"{path}, line {number}: {length} bytes, longer than any row fedguard writes (at most "
                f"{limits.MAX_LINE_BYTES} bytes, fedguard.limits.MAX_LINE_BYTES); refused"
            )
        if size > len(piece):
            handle.seek(start)
            piece = handle.read(size)
        yield number, piece[:length], ended


def read_jsonl(path: Path, note: Note = warn) -> list[dict[str, Any]]:
    """The rows of ``path``, a missing file none; blank lines are skipped. The file is read line by line.

    A last line without its newline that is not a row is what a stopped writer leaves: it is skipped and
    ``note`` told. Any other line that is not a row raises ``RunFileError`` with the file and line, and so
    does a line longer than ``fedguard.limits.MAX_LINE_BYTES`` (its size named, the line never held whole).
    """
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    with open(path, "rb") as handle:
        for number, line, ended in _lines(path, handle):
            if not line.strip():
                continue
            if ended:
                rows.append(_row(path, number, line))
                continue
            try:
                rows.append(_row(path, number, line))
            except RunFileError:
                note(f"{path}: skipped the torn last line {number} ({len(line)} bytes, no newline)")
    return rows


def read_json(path: Path) -> dict[str, Any] | None:
    """The object in the JSON file ``path`` (non-finite floats put back), or None when there is none; a file
    larger than ``fedguard.limits.MAX_LINE_BYTES`` is refused (``RunFileError``) unread."""
    path = Path(path)
    if not path.is_file():
        return None
    size = path.stat().st_size
    if size > limits.MAX_LINE_BYTES:
        raise RunFileError(
            f"{path}: {size} bytes, larger than any JSON file fedguard writes (at most {limits.MAX_LINE_BYTES} "
            "bytes, fedguard.limits.MAX_LINE_BYTES); refused"
        )
    try:
        return _parse(path.read_bytes())
    except _UNREADABLE as error:
        raise RunFileError(f"{path}: not a JSON object ({error})") from None
