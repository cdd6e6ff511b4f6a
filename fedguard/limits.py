"""Where configured values stop working, and the checks that find it without loading or allocating anything.

The limits, and why:

- Integers: ``INT64_MIN``..``INT64_MAX``. ``flwr run`` carries every run-config integer as a 64-bit signed
  integer and refuses to start a run with a larger one. The seed is used by ``torch.manual_seed`` (which takes
  up to 2**64 - 1) and numpy's ``SeedSequence`` (any size), so ``0 <= seed <= INT64_MAX``.
- Floats: finite. No key means anything by NaN or infinity (an infinite learning rate trains a NaN model).
- ``MAX_ROUNDS`` federated rounds (each round is seconds at the least: 100,000 of them are days of running)
  and ``MAX_CLIENTS`` clients (one simulated SuperNode each); ``MAX_LOCAL_EPOCHS`` local epochs per round;
  ``MAX_IMAGE_SIZE`` pixels a side (a 1024 x 1024 RGB image is 12 MiB as float32, per sample of a batch);
  ``MAX_PROCESSES`` attack worker processes, torch threads per worker, or uploads attacked in one batch (beyond
  the cores and memory of one machine).
- ``train.lr`` below ``MAX_LR``: one SGD step moves a weight by the learning rate times its gradient, and a rate of
  10^6 or more turns the global model non-finite within a round (1e308: at the first step), which stops the run.
  The same bound holds every other step size: ``defense.censor.probe-lr`` and the server steps of Flower's
  strategies (``eta``, ``server-learning-rate``); a server momentum is below 1 (at 1 or more the velocity grows
  every round), and FedProx's ``train.lr * proximal-mu`` below 2 (each local step multiplies the distance to the
  global model by ``1 - lr * mu``, which grows without bound beyond 2: every upload turns non-finite).
- ``MAX_NOISE_STD``: the standard deviation of a DP defense's noise on an upload entry (``clip * noise-multiplier``,
  gradient units). Uploads are float32 (largest 3.4e38): a draw of many standard deviations, added up over
  ``MAX_CLIENTS`` uploads, stays finite below 1e30; at ``clip * noise-multiplier`` = 1e307 every upload held an
  infinity and was rejected, so the run trained on nothing.
- ``defense.dp-sgd.noise-multiplier`` 0 (no noise: epsilon infinite) or within ``SGM_NOISE_RANGE``: the RDP
  accountant (opacus) overflows from 1e155, divides by zero at 1e-308 and ran for minutes at 1e-160; at 1e-3 its
  epsilon is 5e8 (no privacy at all), from 1e4 on the floor its orders reach (0.0035 at delta 1e-5).
- ``MAX_LAYERS`` layers of a model whose depth is a parameter: building a model of 10^5 layers, even on the
  meta device, takes tens of seconds before its memory can be estimated (``fedguard.memory``).
- ``MAX_LISTED`` integers listed by a selection such as ``capture.rounds = '1-3,2-9'`` (repeats counted): the
  run expands a selection into a set of integers (tens of MB at this limit). The configuration itself counts
  selections on intervals and expands nothing; it also refuses rounds beyond ``train.rounds`` and client ids
  beyond ``partition.num-clients``.
- ``MAX_NESTING`` levels of tables in a preset, well beyond any key's: keys have three parts
  (``defense.dp.epsilon``), a few more where a registered name holds dots.
- ``MAX_META_BYTES``: the JSON description of a captured upload read back from disk (``fedguard.store.observations``;
  its arrays are sized by the model card): a few KiB for a ResNet's entry names, plus one label per example.
- ``PLUGIN_IMPORT_SECONDS``: importing a ``server.plugins`` module runs its own code; a plugin registers
  components (a second or two with its imports, torch already loaded), so one still importing after a minute
  hangs, and the configuration check names it instead of waiting for ever.
- ``MAX_LINE_BYTES``: one line of a run's ``.jsonl`` file (or a whole JSON file such as ``status.json``) read back
  (``fedguard.store.folder.read_jsonl``). The largest row fedguard writes is a round's with every per-client list
  full: 1,315 bytes per client measured (``encode_row`` of a row whose every client failed with a reason of
  ``FAILURE_CHARS``, with its defense reports, detector findings and straggler id), 125 MiB at ``MAX_CLIENTS``
  clients a round. A longer line is refused naming its file, line and size, measured without holding it.
- Paths: no NUL character, no name longer than the file system's ``PC_NAME_MAX``, no path longer than its
  ``PC_PATH_MAX`` (``os.pathconf``); a run folder keeps ``RUN_FILES_RESERVE`` bytes of that for the files the
  run writes inside it (``observations/round-RRRR_client-CCCC.npz``, ...).
"""

from __future__ import annotations

import math
import os
import re
import reprlib
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_ROUNDS = 100_000
MAX_CLIENTS = 100_000
MAX_LOCAL_EPOCHS = 10_000
MAX_IMAGE_SIZE = 1024
MAX_PROCESSES = 1024
MAX_LAYERS = 1000
MAX_LR = 1e6
MAX_NOISE_STD = 1e30
SGM_NOISE_RANGE = (1e-3, 1e6)
MAX_LISTED = 1_000_000
MAX_NESTING = 8
RUN_FILES_RESERVE = 64
MAX_META_BYTES = 4 * 2**20
PLUGIN_IMPORT_SECONDS = 60.0
MAX_LINE_BYTES = 128 * 2**20

_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlong, _REPR.maxlevel = 80, 80, 60, 3


def shown(value: Any) -> str:
    """``repr(value)``, shortened for a message: long strings and numbers elided in the middle, deep or long
    containers cut."""
    return _REPR.repr(value)


def finite_problem(key: str, value: float) -> str | None:
    """Why ``value`` of float key ``key`` is refused (NaN or infinite), or None."""
    if math.isfinite(value):
        return None
    return f"{key} = {shown(value)}: must be a finite number"


def nesting_problem(table: Mapping[str, Any], limit: int = MAX_NESTING) -> str | None:
    """The first table of ``table`` nested more than ``limit`` deep, described, or None (iterative: any depth)."""
    stack: list[tuple[Mapping[str, Any], tuple[str, ...]]] = [(table, ())]
    while stack:
        current, path = stack.pop()
        for name, value in current.items():
            if not isinstance(value, Mapping):
                continue
            if len(path) + 1 > limit:
                dotted = ".".join((*path, str(name)))
                return (
                    f"table {shown(dotted)} is nested more than {limit} deep, deeper than any key (keys "
                    f"have three parts, e.g. defense.dp.epsilon)"
                )
            stack.append((value, (*path, str(name))))
    return None


def path_problem(key: str, path: str, reserve: int = 0, under: str = "") -> str | None:
    """Why ``path`` (in folder ``under``, relative to the working directory) cannot name a file here, with
    ``reserve`` bytes of the path length kept for names beneath it, or None."""
    if "\x00" in path:
        return f"{key} = {shown(path)}: a path cannot hold a NUL character"
    try:
        absolute = os.fsencode(os.path.abspath(os.path.join(under, os.path.expanduser(path))))
    except UnicodeError:
        return f"{key} = {shown(path)}: cannot be written as a file name on this system"
    path_max = _pathconf(os.getcwd(), "PC_PATH_MAX")
    if path_max is not None and len(absolute) + reserve >= path_max:
        return (
            f"{key} = {shown(path)}: its absolute path has {len(absolute)} bytes; this file system takes "
            f"fewer than {path_max - reserve} (PC_PATH_MAX {path_max}"
            f"{f', less {reserve} for the files inside' if reserve else ''})"
        )
    name_max = _pathconf(_nearest_folder(absolute), "PC_NAME_MAX")
    longest = max(absolute.split(b"/"), key=len)
    if name_max is not None and len(longest) > name_max:
        return (
            f"{key} = {shown(path)}: the name {shown(os.fsdecode(longest))} has {len(longest)} bytes; this "
            f"file system takes at most {name_max} (PC_NAME_MAX)"
        )
    return None


RUN_NAME = re.compile(r"[A-Za-z0-9._-]+")
"""What a run name may hold: one path component of letters, digits, '.', '_' and '-'."""


def name_problem(key: str, name: str) -> str | None:
    """Why ``name`` cannot name a run (one folder under ``runs/``), or None: a name is one path component of
    letters, digits, '.', '_' and '-', and neither '.' nor '..'; ``--out`` chooses any other folder."""
    if RUN_NAME.fullmatch(name) and name not in (".", ".."):
        return None
    return (
        f"{key} = {shown(name)}: a run name is one folder name of letters, digits, '.', '_' and '-' (not "
        f"'.' or '..'), e.g. 'photos-lenet'; to write the run elsewhere, use --out DIR or out-dir"
    )


def writable_problem(key: str, folder: Path) -> str | None:
    """Why this process cannot create files in ``folder`` (created later if missing), or None: the nearest
    existing folder on its way is probed by creating and removing a temporary file there (a read-only mount, a
    full disk, missing permissions); a path that runs through a file is named as such."""
    existing = Path(folder).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{key} = {shown(str(folder))}: {existing} is a file, not a folder; choose a folder to write the run in"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        return f"{key} = {shown(str(folder))}: cannot write in {existing} ({error.strerror}); choose a writable folder"
    return None


def _nearest_folder(absolute: bytes) -> bytes:
    """The deepest existing folder on the way to ``absolute``."""
    folder = absolute
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    return folder


def _pathconf(folder: str | bytes, name: str) -> int | None:
    """``os.pathconf(folder, name)``, or None where the system sets no limit or cannot tell."""
    try:
        value = os.pathconf(folder, name)
    except (OSError, ValueError):
        return None
    return value if value > 0 else None
