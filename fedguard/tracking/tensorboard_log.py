"""TensorBoard: event files in ``<run>/tensorboard`` written through PyTorch's ``SummaryWriter``.

Tags: ``accuracy`` and ``loss`` per round (step: the round), ``defense/<name>`` for the defense's totals,
``attack/<attack>/<score>`` per attacked upload (step: the upload's round), images
``images/<attack>/round-RRRR_client-CCCC`` (the true batch in a row above its reconstruction), and the configuration
as text (``config``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedguard.config import Config
from fedguard.report.images import grid_array
from fedguard.report.run_dir import config_toml
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

    def start(self, config: Config) -> None:
        text = config_toml(config)
        self.writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)  # markdown: a code block

    def round(self, row: dict[str, Any]) -> None:
        for key, value in round_scalars(row).items():
            self.writer.add_scalar(key, value, row["round"])
        self.writer.flush()

    def attack(self, row: dict[str, Any], truth: np.ndarray | None, recon: np.ndarray | None) -> None:
        step = row.get("round") if isinstance(row.get("round"), int) else 0
        for key, value in attack_scalars(row).items():
            self.writer.add_scalar(f"attack/{row['attack']}/{key}", value, step)
        if truth is not None and recon is not None:
            tag = f"images/{row['attack']}/round-{row['round']:04d}_client-{row['client']:04d}"
            grid = grid_array(np.concatenate([truth, recon]), columns=len(truth), scale=None)  # truth above recon
            self.writer.add_image(tag, grid, step, dataformats="HW" if grid.ndim == 2 else "HWC")
        self.writer.flush()

    def finish(self, status: str) -> None:
        self.writer.add_text("status", status, 0)
        self.writer.close()
