"""Captured uploads on disk: one observation is one ``.npz`` file (no pickles) with arrays ``global/<i>`` and
``upload/<i>`` for the i-th ``state_dict`` entry and ``meta``, a JSON string with every other field
(``Observation.meta``); ``DiskSink`` writes a run's as the server captures them. Files a run did not write
itself are read with the checks of ``fedguard.store.observations``.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from pathlib import Path

import numpy as np

from fedguard.data.spec import DataSpec
from fedguard.observation import Observation
from fedguard.store.folder import UPLOAD_GLOB, RunFileUnwritable, replacing, upload_file_name

log = logging.getLogger(__name__)


def save_observation(obs: Observation, folder: Path) -> Path:
    """Write ``obs`` to ``folder/round-RRRR_client-CCCC.npz`` atomically; returns the path."""
    arrays = {f"global/{i}": a for i, a in enumerate(obs.global_arrays)}
    arrays.update({f"upload/{i}": a for i, a in enumerate(obs.upload)})
    name = upload_file_name(obs.round, obs.client)
    target = folder / name
    with replacing(target, sync=False) as handle:
        # mypy takes **arrays for a value of the keyword-only allow_pickle (a bool)
        np.savez(handle, meta=np.array(json.dumps(obs.meta())), **arrays)  # type: ignore[arg-type]
    return target


def load_observation(path: Path) -> Observation:
    """Read an observation written by ``save_observation``."""
    with np.load(path, allow_pickle=False) as archive:
        meta = json.loads(str(archive["meta"]))
        count = len(meta["names"])
        global_arrays = [archive[f"global/{i}"] for i in range(count)]
        upload = [archive[f"upload/{i}"] for i in range(count)]
    return Observation(
        round=meta["round"],
        client=meta["client"],
        kind=meta["kind"],
        model=meta["model"],
        model_params=meta["model_params"],
        spec=DataSpec(*meta["spec"]),
        names=tuple(meta["names"]),
        trainable=tuple(meta["trainable"]),
        global_arrays=global_arrays,
        upload=upload,
        num_examples=meta["num_examples"],
        declared=meta["declared"],
        manipulation=meta.get("manipulation", "none"),
    )


def load_observations(folder: Path) -> list[Observation]:
    """Every observation in ``folder``, ordered by round then client."""
    return [load_observation(p) for p in sorted(Path(folder).glob(UPLOAD_GLOB))]


class DiskSink:
    """Saves observations to ``folder`` on a background thread (``save_observation``)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.saved: list[Path] = []
        self.failed: list[tuple[str, str]] = []
        self.full: RunFileUnwritable | None = None  # the first write that found the disk full
        self._queue: queue.Queue[Observation | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="observation-writer", daemon=True)
        self._thread.start()

    def submit(self, obs: Observation) -> None:
        """Queue ``obs`` for writing; returns immediately. Once a write found the disk full, raises its
        ``RunFileUnwritable``: the run stops rather than go on capturing what it cannot keep."""
        if self.full is not None:
            raise self.full
        self._queue.put(obs)

    def close(self, timeout: float | None = None) -> None:
        """Write everything queued, then stop the writer (waits up to ``timeout`` seconds, any length)."""
        self._queue.put(None)
        self._thread.join(None if timeout is None else min(timeout, threading.TIMEOUT_MAX))
        if self._thread.is_alive():
            log.warning("observation writer still busy after %s s; %d left", timeout, self._queue.qsize())

    def _work(self) -> None:
        while (obs := self._queue.get()) is not None:
            try:
                self.saved.append(save_observation(obs, self.folder))
            except OSError as error:
                name = upload_file_name(obs.round, obs.client)
                self.failed.append((name, str(error)))
                log.error("could not save %s: %s", name, error)
                if isinstance(error, RunFileUnwritable) and self.full is None:
                    self.full = error
