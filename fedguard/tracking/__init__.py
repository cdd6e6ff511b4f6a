"""Experiment tracking, opt in (``[track]``): each row a run writes, as it writes it, also goes to TensorBoard
and/or MLflow.

A tracker receives the configuration once (``start``), each ``rounds.jsonl`` row (``round``), each
``attacks.jsonl`` row with the run folder it was written in (``attack``: the images are read back from the
folder, the true batch from the vault and the reconstruction from its ``.npz``), and how the run ended
(``finish``). ``Trackers`` fans out to the configured ones; a tracker that fails is named in a warning and
left out from then on, so the run and its files never depend on a tracker.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fedguard.config import Config
from fedguard.store.vault import read_scored_images

PROBE_SECONDS = 3.0  # how long the check before a run waits for an MLflow server to answer

log = logging.getLogger(__name__)
MLFLOW_DB, MLFLOW_ARTIFACTS = "mlflow.db", "mlflow-artifacts"  # the local MLflow store in a run folder


class Tracker(Protocol):
    """Where a run's rows are logged besides its folder."""

    name: str

    def start(self, config: Config) -> None: ...

    def round(self, row: dict[str, Any]) -> None: ...

    def attack(self, row: dict[str, Any], truth: np.ndarray | None, recon: np.ndarray | None) -> None: ...

    def finish(self, status: str) -> None: ...


ROUND_SCORES = ("accuracy", "loss", "seconds")
ATTACK_SCORES = ("psnr", "ssim", "lpips", "label_accuracy", "seconds")


def safe_name(key: str) -> str:
    """``key`` with the characters MLflow refuses in a name (``+`` of ``attack.mjolnir+dlg``) as ``_``."""
    return re.sub(r"[^\w\-. :/]", "_", key)


def metric_name(*parts: str) -> str:
    """The one name both trackers give a metric: ``parts`` joined by ``/`` (``attack/ig/ssim``), made safe."""
    return safe_name("/".join(parts))


def _finite(values: dict[str, Any]) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in values.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)
    }


def round_scalars(row: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a ``rounds.jsonl`` row by metric name: ``round/<score>`` of ``ROUND_SCORES`` and
    the defense's totals as ``defense/<name>``."""
    return _finite(
        {
            **{metric_name("round", key): row.get(key) for key in ROUND_SCORES},
            **{metric_name("defense", name): value for name, value in (row.get("defense") or {}).items()},
        }
    )


def attack_scalars(row: dict[str, Any]) -> dict[str, float]:
    """The finite ``ATTACK_SCORES`` of an ``attacks.jsonl`` row as ``attack/<attack>/<score>`` (none for a
    failed attack)."""
    return _finite({metric_name("attack", str(row["attack"]), key): row.get(key) for key in ATTACK_SCORES})


def attack_images(folder: Path, row: dict[str, Any]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(truth, reconstruction) of a scored attack row, each (N, C, H, W) float32 in [0, 1]; None where the
    folder does not hold it."""
    if not row.get("images") or not isinstance(row.get("round"), int) or not isinstance(row.get("client"), int):
        return None, None
    return read_scored_images(folder, row["round"], row["client"], str(row["images"]))


class Trackers:
    """The configured trackers of one run, each guarded: the first exception of a tracker is warned with its
    name and that tracker is dropped."""

    def __init__(self, trackers: list[Tracker], folder: Path) -> None:
        self.trackers = trackers
        self.folder = folder

    def _each(self, action: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, action)(*args)
            except Exception as error:  # a tracker must never stop the run
                log.warning(
                    "tracking: %s failed in %s (%s: %s); the run goes on without it",
                    tracker.name,
                    action,
                    type(error).__name__,
                    error,
                )
                self.trackers.remove(tracker)

    def start(self, config: Config) -> None:
        self._each("start", config)

    def round(self, row: dict[str, Any]) -> None:
        self._each("round", row)

    def attack(self, row: dict[str, Any]) -> None:
        if self.trackers:
            self._each("attack", row, *attack_images(self.folder, row))

    def finish(self, status: str) -> None:
        self._each("finish", status)


def tracker_problems(config: Config) -> list[str]:
    """Why the trackers ``config.track`` turns on cannot run here (a package missing), checked before a run
    starts."""
    needed = [
        ("track.tensorboard", "tensorboard", config.track.tensorboard),
        ("track.mlflow", "mlflow", config.track.mlflow),
    ]
    problems = [
        f"{key} = true needs the {package} package, which is not installed: pip install {package}"
        for key, package, on in needed
        if on and importlib.util.find_spec(package) is None
    ]
    if config.track.mlflow and (problem := mlflow_server_problem(config.track.mlflow_uri)):
        problems.append(problem)
    return problems


def mlflow_server_problem(uri: str) -> str | None:
    """Why no MLflow tracking server answers at ``uri`` (an ``http(s)://`` URI; a local store needs no server),
    probed at its ``/health`` within ``PROBE_SECONDS``; None when something answers there, whatever it says
    (a proxy may ask for credentials the client has)."""
    if not uri.startswith(("http://", "https://")):
        return None
    try:
        urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=PROBE_SECONDS).close()
    except urllib.error.HTTPError:
        return None  # a server answered
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        return (
            f"track.mlflow-uri = {uri!r}: no MLflow server answers there ({reason}); start it "
            f"(mlflow server --host ... --port ...), or leave the key empty for a store in the run folder"
        )
    return None


def open_trackers(config: Config, folder: Path) -> Trackers:
    """The trackers ``config.track`` turns on for the run in ``folder``, started with the configuration; one
    that cannot be opened (an MLflow server that does not answer) is named in a warning and left out."""
    trackers: list[Tracker] = []
    for key, on in (("tensorboard", config.track.tensorboard), ("mlflow", config.track.mlflow)):
        if not on:
            continue
        try:
            trackers.append(_open(key, config, folder))
        except Exception as error:
            log.warning(
                "tracking: %s could not be opened (%s: %s); the run goes on without it",
                key,
                type(error).__name__,
                error,
            )
    result = Trackers(trackers, folder)
    result.start(config)
    return result


def _open(name: str, config: Config, folder: Path) -> Tracker:
    if name == "tensorboard":
        from fedguard.tracking.tensorboard_log import TensorBoardTracker

        return TensorBoardTracker(folder / "tensorboard")
    from fedguard.tracking.mlflow_log import MLflowTracker

    if config.track.mlflow_uri:
        return MLflowTracker(config.track.mlflow_uri, config.track.mlflow_experiment, folder)
    uri, artifacts = local_store(folder)
    return MLflowTracker(uri, config.track.mlflow_experiment, folder, artifacts=artifacts)


def local_store(folder: Path) -> tuple[str, str]:
    """(tracking URI, artifact location) of the MLflow store in ``folder``: ``mlflow.db`` (MLflow 3 refuses its
    plain file store) and ``mlflow-artifacts/``."""
    local = folder.absolute()
    return f"sqlite:///{local / MLFLOW_DB}", (local / MLFLOW_ARTIFACTS).as_uri()
