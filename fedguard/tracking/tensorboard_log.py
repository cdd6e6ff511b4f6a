"""TensorBoard: event files in ``<run>/tensorboard`` written through PyTorch's ``SummaryWriter``.

Tags, named as in MLflow (``fedguard.tracking.metric_name``): ``round/accuracy``, ``round/loss``,
``round/seconds`` and ``defense/<name>`` per round (step: the round), ``attack/<attack>/<score>`` per attacked
upload (step: the upload's round), images ``images/<attack>/round-RRRR_client-CCCC`` (the true batch in a row above
its reconstruction), and the configuration as text (``config``). At the end, an HParams session: the keys the
run uses (``Config.used_flat``) as hyperparameters and each metric's last value, to compare runs in
TensorBoard's HParams tab (``tensorboard --logdir`` a folder of runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedguard.config import Config
from fedguard.report.images import grid_array
from fedguard.store.run_dir import config_toml
from fedguard.tracking import attack_scalars, round_scalars


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ImportError(
                "track.tensorboard = true needs the tensorboard package: pip install tensorboard"
            ) from error
        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.hparams: dict[str, Any] = {}
        self.last: dict[str, float] = {}  # metric name -> its last value

    def start(self, config: Config) -> None:
        text = config_toml(config)
        self.writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)  # markdown: a code block
        self.hparams = config.used_flat()

    def _scalars(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.last.update(values)

    def round(self, row: dict[str, Any]) -> None:
        self._scalars(round_scalars(row), row["round"])
        self.writer.flush()

    def attack(self, row: dict[str, Any], truth: np.ndarray | None, recon: np.ndarray | None) -> None:
        step = row["round"] if isinstance(row.get("round"), int) else 0
        self._scalars(attack_scalars(row), step)
        if truth is not None and recon is not None:
            tag = f"images/{row['attack']}/round-{row['round']:04d}_client-{row['client']:04d}"
            grid = grid_array(np.concatenate([truth, recon]), columns=len(truth), scale=None)  # truth above recon
            self.writer.add_image(tag, grid, step, dataformats="HW" if grid.ndim == 2 else "HWC")
        self.writer.flush()

    def finish(self, status: str) -> None:
        from torch.utils.tensorboard.summary import hparams

        self.writer.add_text("status", status, 0)
        # The session goes in this run's own event file (SummaryWriter.add_hparams would open a sub-folder).
        # Its metrics name the scalar tags above; TensorBoard shows their last values.
        for summary in hparams({**self.hparams, "status": status}, self.last):
            self.writer._get_file_writer().add_summary(summary)
        self.writer.close()
