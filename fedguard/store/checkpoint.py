"""``checkpoint.npz``: the global model and the strategy's state after the last completed round, written
atomically after each round's row, read when a run resumes (``fedguard.store.resume``).

Arrays only (``numpy.load(allow_pickle=False)``): ``round`` (0-d int64), ``model/<i>`` the global model's arrays
in order with their names in ``names``, and ``strategy/<name>`` (``strategies.state``).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedguard.store.folder import CHECKPOINT_FILE, write_atomic

_MODEL, _STRATEGY = "model/", "strategy/"


class CheckpointError(ValueError):
    """A checkpoint that is missing or cannot be read as written."""


@dataclass(frozen=True)
class RoundCheckpoint:
    """Where a run stood after ``round`` (>= 0) completed."""

    round: int
    names: tuple[str, ...]
    arrays: list[np.ndarray]
    strategy: dict[str, np.ndarray] = field(default_factory=dict)


def write_checkpoint(folder: Path, checkpoint: RoundCheckpoint) -> Path:
    """``folder/checkpoint.npz``, replaced atomically."""
    content = {"round": np.asarray(checkpoint.round, dtype=np.int64), "names": np.asarray(checkpoint.names, dtype=str)}
    content.update({f"{_MODEL}{i}": np.asarray(a) for i, a in enumerate(checkpoint.arrays)})
    content.update({f"{_STRATEGY}{name}": np.asarray(a) for name, a in checkpoint.strategy.items()})
    buffer = io.BytesIO()
    # mypy takes **content for a value of the keyword-only allow_pickle (a bool)
    np.savez(buffer, **content)  # type: ignore[arg-type]
    return write_atomic(Path(folder) / CHECKPOINT_FILE, buffer.getvalue())


def read_checkpoint(folder: Path) -> RoundCheckpoint:
    """The checkpoint in ``folder``; ``CheckpointError`` naming the file when it is missing or malformed."""
    path = Path(folder) / CHECKPOINT_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path} does not exist: the run finished no round, or was started before runs "
            "kept checkpoints; start it again"
        )
    try:
        with np.load(path, allow_pickle=False) as stored:
            round_ = int(stored["round"])
            names = tuple(str(n) for n in stored["names"])
            arrays = [stored[f"{_MODEL}{i}"] for i in range(len(names))]
            strategy = {k[len(_STRATEGY) :]: stored[k] for k in stored.files if k.startswith(_STRATEGY)}
    except (OSError, ValueError, KeyError, EOFError) as error:
        raise CheckpointError(f"{path} cannot be read ({type(error).__name__}: {error})") from None
    if round_ < 0:
        raise CheckpointError(f"{path}: round {round_} is negative")
    return RoundCheckpoint(round_, names, arrays, strategy)
