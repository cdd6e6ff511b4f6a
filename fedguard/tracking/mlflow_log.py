"""MLflow: one MLflow run per fedguard run, through ``MlflowClient`` at a tracking URI (a server, a SQLite file
several runs share, or the store ``mlflow.db`` with ``mlflow-artifacts/`` in the run folder).

The MLflow run is named after the run folder (its path below the parent's folder when ``track.mlflow-parent``
nests it, as ``fedguard sweep`` does: ``privacy/dp/seed-0``). Parameters: the keys the run uses
(``Config.used_flat``). Metrics, named as in TensorBoard (``fedguard.tracking.metric_name``): ``round/accuracy``,
``round/loss``, ``defense/<name>`` per round (step: the round) and ``attack/<attack>/<score>`` per attacked
upload (step: its round). Artifacts: each attacked upload's true batch and reconstruction as PNG grids under
``images/``. The run ends ``FINISHED``, or ``FAILED`` / ``KILLED`` as the fedguard run did.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from fedguard.config import Config
from fedguard.report.images import grid_array
from fedguard.tracking import attack_scalars, round_scalars, safe_name

ENDINGS = {"completed": "FINISHED", "interrupted": "KILLED"}  # anything else: FAILED
BATCH = 100  # parameters per log_batch call (MLflow's limit)
# A server that stops answering mid-run costs one call of at most about a minute before the tracker is dropped
# (MLflow's own defaults retry for minutes per call); the environment's own values win.
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
FOLDER_TAG = "fedguard.folder"  # the absolute folder of a run (a sweep's parent run: the sweep folder)
# MLflow's SQL store module configures its tables, as it is imported, with a loader SQLAlchemy 2 deprecates.
NOLOAD_WARNING = "The ``noload`` loader strategy is deprecated"


def open_client(uri: str) -> Any:
    """An ``MlflowClient`` at ``uri``, MLflow's SQL store imported without the SQLAlchemy deprecation warning
    its import raises."""
    try:
        from mlflow import MlflowClient

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=NOLOAD_WARNING, category=DeprecationWarning)
            import mlflow.store.tracking.sqlalchemy_store  # noqa: F401 - imported here, its warning silenced
    except ImportError as error:
        raise ImportError("track.mlflow = true needs the mlflow package: pip install mlflow") from error
    for name, value in HTTP_LIMITS.items():
        os.environ.setdefault(name, value)
    return MlflowClient(tracking_uri=uri)


def experiment_id(client: Any, experiment: str, artifacts: str | None = None) -> str:
    """The id of ``experiment``, created when missing with its artifacts at ``artifacts`` (None: the tracking
    server's choice)."""
    found = client.get_experiment_by_name(experiment)
    return str(found.experiment_id if found else client.create_experiment(experiment, artifact_location=artifacts))


def run_name(folder: Path, parent_folder: str | None) -> str:
    """The MLflow run name of the run in ``folder``: its path below ``parent_folder`` when it lies there, else
    the folder's name."""
    here = folder.absolute()
    if parent_folder and here.is_relative_to(parent_folder):
        return here.relative_to(parent_folder).as_posix()
    return here.name


class MLflowTracker:
    name = "mlflow"

    def __init__(self, uri: str, experiment: str, folder: Path, artifacts: str | None = None) -> None:
        """``folder``: the run folder; ``artifacts``: where a new experiment keeps its artifacts."""
        self.client = open_client(uri)
        self.experiment_id = experiment_id(self.client, experiment, artifacts)
        self.folder = folder
        self.run_id = ""

    def start(self, config: Config) -> None:
        from mlflow.entities import Param

        tags = {
            "fedguard.defense": config.defense.name,
            "fedguard.attacks": ",".join(config.attack_names()) or "none",
            FOLDER_TAG: str(self.folder.absolute()),
        }
        parent_folder = None
        if parent := config.track.mlflow_parent:
            parent_folder = self.client.get_run(parent).data.tags.get(FOLDER_TAG)
            tags["mlflow.parentRunId"] = parent
        run = self.client.create_run(self.experiment_id, run_name=run_name(self.folder, parent_folder), tags=tags)
        self.run_id = run.info.run_id
        params = [Param(safe_name(key), str(value)[:6000]) for key, value in config.used_flat().items()]
        for start in range(0, len(params), BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + BATCH])

    def _metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        if values:
            stamp = int(time.time() * 1000)
            self.client.log_batch(
                self.run_id, metrics=[Metric(key, value, stamp, step) for key, value in values.items()]
            )

    def round(self, row: dict[str, Any]) -> None:
        self._metrics(round_scalars(row), row["round"])

    def attack(self, row: dict[str, Any], truth: np.ndarray | None, recon: np.ndarray | None) -> None:
        self._metrics(attack_scalars(row), row["round"] if isinstance(row.get("round"), int) else 0)
        if truth is not None and recon is not None:
            stem = f"images/round-{row['round']:04d}_client-{row['client']:04d}_{row['attack']}"
            self.client.log_image(self.run_id, grid_array(truth, scale=None), artifact_file=f"{stem}_truth.png")
            self.client.log_image(self.run_id, grid_array(recon, scale=None), artifact_file=f"{stem}_recon.png")

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, ENDINGS.get(status, "FAILED"))
