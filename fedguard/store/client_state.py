"""A simulated client's state as files under the run folder (``client-state/client-CCCC/round-RRRR.npz``): no
process holds the state of idle clients, so memory does not grow with the number of clients, and a resumed run
(``fedguard run --resume``) finds the state of its last completed round.

``FileState`` keeps versions by round: ``load(r)`` reads the newest file of a round before ``r`` and
``store(r, ...)`` writes round ``r``'s file atomically, then deletes the files older than the one it read. A
round that never completed (the run was killed during it) leaves a newer file that ``discard_after`` removes
before the run resumes. The arrays are written as they are (``numpy.save``): the state reloads bit for bit.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from fedguard.store.folder import replacing

_ROUND_FILE = re.compile(r"round-(\d+)\.npz")


def client_folder(root: Path, client: int) -> Path:
    """``root/client-CCCC``: the state files of one client."""
    return Path(root) / f"client-{client:04d}"


def _rounds(folder: Path) -> dict[int, Path]:
    """Round -> state file in ``folder`` (empty when it does not exist)."""
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        match = _ROUND_FILE.fullmatch(path.name)
        if match:
            found[int(match.group(1))] = path
    return found


class FileState:
    """One client's state as files under ``root`` (``client-CCCC/round-RRRR.npz``), versioned by round.

    Parameters
    ----------
    root : Path
        The run's state folder (``fedguard.store.folder.CLIENT_STATE_DIR`` of the run folder).
    client : int
        The client whose state this is.
    """

    def __init__(self, root: Path, client: int) -> None:
        self.folder = client_folder(root, client)
        self._read: int | None = None

    def load(self, round_: int) -> dict[str, torch.Tensor]:
        earlier = [r for r in _rounds(self.folder) if r < round_]
        if not earlier:
            self._read = None
            return {}
        self._read = max(earlier)
        path = self.folder / f"round-{self._read:04d}.npz"
        try:
            with np.load(path, allow_pickle=False) as stored:
                return {name: torch.from_numpy(stored[name].copy()) for name in stored.files}
        except (OSError, ValueError) as error:
            raise ValueError(
                f"client state {path} cannot be read ({error}); delete the folder "
                f"{self.folder.parent} to start every client's state afresh"
            ) from None

    def store(self, round_: int, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors and self._read is None:  # stateless, and nothing before to supersede
            return
        target = self.folder / f"round-{round_:04d}.npz"
        arrays = {name: t.detach().cpu().contiguous().numpy() for name, t in tensors.items()}
        with replacing(target, sync=False) as out:
            # mypy takes **arrays for a value of the keyword-only allow_pickle (a bool)
            np.savez(out, **arrays)  # type: ignore[arg-type]
        for older, path in _rounds(self.folder).items():
            if older < round_ and (self._read is None or older < self._read):
                path.unlink(missing_ok=True)


def discard_after(root: Path, round_: int) -> int:
    """Delete every client's state files of rounds after ``round_`` (left by a round that never completed);
    returns how many."""
    removed = 0
    if not Path(root).is_dir():
        return 0
    for folder in Path(root).iterdir():
        for later, path in _rounds(folder).items():
            if later > round_:
                path.unlink(missing_ok=True)
                removed += 1
    return removed
