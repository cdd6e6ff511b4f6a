"""Checks of the trained files fedguard loads, with one error type that says what is wrong and how to fix it.

Generators, evaluation networks, Mjölnir's diffusion models, its training checkpoints and its gradient sets
are each one ``.npz`` written by ``fedguard.trained.archive.save_archive``: named arrays and a JSON ``meta`` string.
Their loaders share these checks: ``read_archive`` opens a file without unpickling anything and checks its
layout and the format its meta declares; ``check_arrays`` checks the arrays' names, shapes and dtypes
against what the meta describes, and that every float is finite; ``described`` reports a meta that lacks a
field or holds an invalid one. Each problem raises ``TrainedFileError`` (``MissingTrainedFile`` when nothing
is at the path), whose message names the file, what is wrong and the command that makes a good one.
"""

from __future__ import annotations

import json
import zipfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import numpy as np

from fedguard.registry import MissingTrainedFile, TrainedFileError

T = TypeVar("T")
Layout = Mapping[str, tuple[tuple[int, ...], np.dtype]]
"""Array name -> (shape, dtype) a file must hold; a size of -1 matches any size."""

NPY_MAGIC = b"\x93NUMPY"
"""How a single ``.npy`` array starts."""
ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
"""How a zip archive (``.npz``) starts: a first entry, or the end record of an empty archive."""
READ_ERRORS = (
    OSError,
    EOFError,
    ValueError,
    zipfile.BadZipFile,
    zlib.error,
    NotImplementedError,
    RuntimeError,
    MemoryError,
)
"""What numpy and zipfile raise on a damaged ``.npz`` archive (MemoryError: a header claiming a huge array)."""
META_ERRORS = (KeyError, TypeError, ValueError, AttributeError, RuntimeError)
"""What building an object from a meta that lacks a field or holds an invalid one raises."""


@dataclass(frozen=True)
class FileKind:
    """One kind of trained file: its ``name`` ('generator'), the ``noun`` a file of that kind is ('a generator
    file'), the ``format`` its meta declares, the ``keys`` it holds besides prefixed arrays (``meta`` first),
    and ``command(path)``: the command that writes a good one at ``path``, in backticks."""

    name: str
    noun: str
    format: str
    keys: tuple[str, ...]
    command: Callable[[Path], str]

    def missing(self, path: Path) -> MissingTrainedFile:
        """The error for nothing at ``path``."""
        return MissingTrainedFile(f"no {self.name} at {path}; create it with {self.command(path)}")

    def foreign(self, path: Path, reason: str) -> TrainedFileError:
        """The error for a file at ``path`` that is not of this kind at all, for ``reason``."""
        return TrainedFileError(f"{path} is not {self.noun}: {reason}; create one with {self.command(path)}")

    def error(self, path: Path, problem: str) -> TrainedFileError:
        """The error for a file of this kind at ``path`` with ``problem``."""
        return TrainedFileError(f"{path}: {problem}; recreate it with {self.command(path)}")


def read_archive(path: Path, kind: FileKind) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The meta (a dict, of ``kind``'s format) and every other array (name -> array) of the file at ``path``."""
    check_path(path, kind)
    arrays = read_arrays(path, kind)
    meta = parse_meta(arrays.pop("meta"), path, kind)
    if meta.get("format") != kind.format:
        raise kind.error(path, f"format {meta.get('format')!r}, expected {kind.format!r}")
    return meta, arrays


def check_path(path: Path, kind: FileKind) -> None:
    """Raises ``TrainedFileError`` unless ``path`` is a regular file that starts as an ``.npz`` archive does."""
    if not path.exists():
        raise kind.missing(path)
    if not path.is_file():
        raise kind.foreign(path, "it is a directory" if path.is_dir() else "it is not a regular file")
    try:
        with path.open("rb") as handle:
            start = handle.read(len(NPY_MAGIC))
    except OSError as error:
        raise kind.error(path, f"it cannot be read ({error.strerror or error})") from None
    if not start:
        raise kind.foreign(path, "it is empty")
    if start.startswith(NPY_MAGIC):
        raise kind.foreign(path, "it holds one array, not an .npz archive of named arrays")
    if not start.startswith(ZIP_MAGIC):
        raise kind.foreign(path, "it is not an .npz archive (a zip of .npy arrays)")


def read_arrays(path: Path, kind: FileKind) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` at ``path`` by name, read without unpickling; it must hold ``kind.keys``."""
    try:
        loaded = np.load(path, allow_pickle=False)
    except READ_ERRORS as error:
        raise kind.foreign(path, f"it is a damaged zip archive ({type(error).__name__}: {error})") from None
    with loaded as archive:
        missing = [key for key in kind.keys if key not in archive.files]
        if missing:
            raise kind.foreign(path, f"it lacks {', '.join(missing)}")
        return {name: read_member(archive, name, path, kind) for name in archive.files}


def read_member(archive: np.lib.npyio.NpzFile, name: str, path: Path, kind: FileKind) -> np.ndarray:
    """The array ``name`` of ``archive``; ``TrainedFileError`` for a damaged entry, pickled objects or raw bytes."""
    try:
        value = archive[name]
    except READ_ERRORS as error:
        raise kind.error(path, f"key {name!r} cannot be read ({type(error).__name__}: {error})") from None
    if not isinstance(value, np.ndarray):
        raise kind.foreign(path, f"key {name!r} is not a .npy array")
    return value


class NonFiniteMeta(ValueError):
    """A NaN or infinity in a meta's JSON."""


def reject_constant(name: str) -> NoReturn:
    """``json.loads``'s ``parse_constant``: refuses NaN, Infinity and -Infinity."""
    raise NonFiniteMeta(name)


def parse_meta(value: np.ndarray, path: Path, kind: FileKind) -> dict[str, Any]:
    """The JSON object of the 0-d string array ``meta``; every number in it finite."""
    if value.shape != () or value.dtype.kind != "U":
        raise kind.foreign(path, f"its meta is an array of {value.dtype} and shape {value.shape}, not a JSON string")
    try:
        meta = json.loads(str(value), parse_constant=reject_constant)
    except NonFiniteMeta as error:
        raise kind.error(path, f"its meta holds the non-finite number {error}") from None
    except ValueError as error:
        raise kind.foreign(path, f"its meta is not valid JSON ({error})") from None
    if not isinstance(meta, dict):
        raise kind.foreign(path, f"its meta is a JSON {type(meta).__name__}, not an object")
    return meta


def check_arrays(arrays: Mapping[str, np.ndarray], layout: Layout, path: Path, kind: FileKind, label: str) -> None:
    """Raises ``TrainedFileError`` unless ``arrays`` has exactly the names of ``layout``, each with its shape
    and a dtype of its dtype's kind, and finite floats; ``label`` names the arrays ('decoder')."""
    problems = layout_problems(arrays, layout)
    if problems:
        raise kind.error(path, f"{label} arrays in the file do not match its meta: {'; '.join(problems)}")
    check_finite(arrays, path, kind)


def layout_problems(arrays: Mapping[str, np.ndarray], layout: Layout) -> list[str]:
    """Each missing or unexpected name, wrong shape and wrong dtype kind of ``arrays`` against ``layout``."""
    problems = [f"missing key {name!r}" for name in layout if name not in arrays]
    problems += [f"unexpected key {name!r}" for name in arrays if name not in layout]
    for name, (shape, dtype) in layout.items():
        array = arrays.get(name)
        if array is None:
            continue
        if not shape_matches(array.shape, shape):
            problems.append(f"key {name!r} has shape {array.shape}, expected {shape}")
        elif array.dtype.kind != dtype.kind:
            problems.append(f"key {name!r} has dtype {array.dtype}, expected {dtype}")
    return problems


def shape_matches(found: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Whether ``found`` is ``expected``, a size of -1 in ``expected`` matching any size."""
    return len(found) == len(expected) and all(e in (-1, f) for f, e in zip(found, expected))


def check_finite(arrays: Mapping[str, np.ndarray], path: Path, kind: FileKind) -> None:
    """Raises ``TrainedFileError`` naming the first float array of ``arrays`` with a NaN or an infinity."""
    for name, array in arrays.items():
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            nan, inf = int(np.isnan(array).sum()), int(np.isinf(array).sum())
            raise kind.error(path, f"non-finite values in key {name!r} ({nan} NaN, {inf} infinite of {array.size})")


def load_trained(
    path: Path | str, kind: FileKind, build: Callable[[dict[str, Any], dict[str, np.ndarray], Path], T]
) -> T:
    """What ``build(meta, arrays, path)`` makes of the file of ``kind`` at ``path`` (``read_archive``'s meta and
    arrays). Raises ``TrainedFileError`` (``MissingTrainedFile`` for a missing file) for a file that is not of
    ``kind``, and for a meta ``build`` finds lacking or invalid (``described``)."""
    path = Path(path)
    meta, arrays = read_archive(path, kind)
    return described(lambda: build(meta, arrays, path), path, kind)


def described(build: Callable[[], T], path: Path, kind: FileKind) -> T:
    """``build()``, which makes an object from the meta of the file at ``path``; a field it lacks or an invalid
    value raises ``TrainedFileError``."""
    try:
        return build()
    except TrainedFileError:
        raise
    except KeyError as error:
        raise kind.error(path, f"its meta lacks {error}") from None
    except META_ERRORS as error:
        raise kind.error(path, f"its meta is invalid ({type(error).__name__}: {error})") from None


def refuse(missing: list[str], unusable: list[str], whose: str) -> None:
    """Raises one error listing each ``missing`` file (a ``MissingTrainedFile`` then) and each ``unusable`` one
    that ``whose`` ('the configured attacks') load; nothing when both lists are empty."""
    if missing or unusable:
        error = MissingTrainedFile if missing else TrainedFileError
        raise error(f"files {whose} load cannot be used:\n  " + "\n  ".join(missing + unusable))
