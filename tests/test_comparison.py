"""The comparison figure: one band per attack, the client's batch beside its reconstruction."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fedguard.report.comparison import COMPARISON_FILE, GAP, LABEL_WIDTH, write_comparison
from fedguard.report.images import save_grid


def test_comparison_figure_has_one_band_per_attack(tmp_path: Path) -> None:
    truth = torch.rand(2, 1, 8, 8)
    rows = []
    for attack in ("ig", "imprint", "ig"):
        prefix = f"images/{attack}-{len(rows)}"
        save_grid(truth, tmp_path / f"{prefix}_truth.png", scale=None)
        save_grid(1 - truth, tmp_path / f"{prefix}_recon.png", scale=None)
        rows.append(
            {
                "attack": attack,
                "status": "ok",
                "images": prefix,
                "round": 1,
                "client": 0,
                "batch_size": 2,
                "psnr": 12.0,
                "ssim": 0.5,
                "lpips": 0.2,
                "floor": {"psnr": 9.0, "ssim": 0.1},
            }
        )
    rows.append({"attack": "dlg", "status": "error", "images": None})
    (tmp_path / "attacks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = write_comparison(tmp_path)
    assert path == tmp_path / COMPARISON_FILE
    figure = np.asarray(Image.open(path).convert("L"))
    grid = np.asarray(Image.open(tmp_path / "images/ig-0_truth.png").convert("L"))
    bands = [
        top
        for top in range(figure.shape[0] - grid.shape[0] + 1)
        if np.array_equal(
            figure[top : top + grid.shape[0], LABEL_WIDTH + GAP : LABEL_WIDTH + GAP + grid.shape[1]], grid
        )
    ]
    assert len(bands) == 2  # ig (its first row only) and imprint; the failed dlg has none
    assert write_comparison(tmp_path / "empty") is None
