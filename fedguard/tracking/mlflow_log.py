"""MLflow: one MLflow run per fedguard run, through ``MlflowClient`` at a tracking URI (a server, or the
SQLite store ``mlflow.db`` with ``mlflow-artifacts/`` in the run folder).

Parameters: every configuration key (``train.rounds``, ...). Metrics: ``accuracy`` and ``loss`` per round
(step: the round), ``defense.<name>``, and ``attack.<attack>.<score>`` per attacked upload (step: its round).
Artifacts: each attacked upload's true batch and reconstruction as PNG grids under ``images/``. The run ends
``FINISHED``, or ``FAILED`` / ``KILLED`` as the fedguard run did.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import numpy as np

from fedguard.config import Config
from fedguard.report.images import grid_array
from fedguard.tracking import attack_scalars, round_scalars

ENDINGS = {"completed": "FINISHED", "interrupted": "KILLED"}  # anything else: FAILED
BATCH = 100  # parameters per log_batch call (MLflow's limit)
# A server that stops answering mid-run costs one call of at most about a minute before the tracker is dropped
# (MLflow's own defaults retry for minutes per call); the environment's own values win.
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


def mlflow_name(key: str) -> str:
    """``key`` with the characters MLflow refuses in a name (``+`` of ``attack.mjolnir+dlg``) as ``_``."""
    return re.sub(r"[^\w\-. :/]", "_", key)


class MLflowTracker:
    name = "mlflow"

    def __init__(self, uri: str, experiment: str, artifacts: str | None = None) -> None:
        """``artifacts``: where a new experiment keeps its artifacts (None: the tracking server's choice)."""
        try:
            from mlflow import MlflowClient
        except ImportError as error:
            raise ImportError("track.mlflow = true needs the mlflow package: pip install mlflow") from error
        for name, value in HTTP_LIMITS.items():
            os.environ.setdefault(name, value)
        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        self.experiment_id = (
            found.experiment_id if found else self.client.create_experiment(experiment, artifact_location=artifacts)
        )
        self.run_id = ""

    def start(self, config: Config) -> None:
        from mlflow.entities import Param

        run = self.client.create_run(
            self.experiment_id,
            run_name=config.run.name,
            tags={
                "fedguard.defense": config.defense.name,
                "fedguard.attacks": ",".join(config.attack_names()) or "none",
            },
        )
        self.run_id = run.info.run_id
        params = [Param(mlflow_name(key), str(value)[:6000]) for key, value in config.to_flat().items()]
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
        self._metrics({key.replace("/", "."): value for key, value in round_scalars(row).items()}, row["round"])

    def attack(self, row: dict[str, Any], truth: np.ndarray | None, recon: np.ndarray | None) -> None:
        step = row["round"] if isinstance(row.get("round"), int) else 0
        self._metrics(
            {mlflow_name(f"attack.{row['attack']}.{key}"): value for key, value in attack_scalars(row).items()}, step
        )
        if truth is not None and recon is not None:
            stem = f"images/round-{row['round']:04d}_client-{row['client']:04d}_{row['attack']}"
            self.client.log_image(self.run_id, grid_array(truth, scale=None), artifact_file=f"{stem}_truth.png")
            self.client.log_image(self.run_id, grid_array(recon, scale=None), artifact_file=f"{stem}_recon.png")

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, ENDINGS.get(status, "FAILED"))
