"""Pairing reconstructed images with the true ones by linear assignment."""

from __future__ import annotations

import numpy as np
import torch

from fedguard.metrics.image import clip_psnr, psnr_from_mse

METRICS = ("mse", "psnr")


def pairwise_mse(recon: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """MSE of every (true, reconstructed) pair: (len(truth), len(recon)), float64."""
    recon = recon.detach().to(torch.float64)
    truth = truth.detach().to(device=recon.device, dtype=torch.float64)
    return torch.stack([(recon - image).pow(2).flatten(1).mean(dim=1) for image in truth])


def match(recon: torch.Tensor, truth: torch.Tensor, metric: str = "mse") -> np.ndarray:
    """Indices ``order`` (len(truth),) such that ``recon[order[i]]`` is the best match of ``truth[i]``.

    ``recon`` (R, C, H, W) and ``truth`` (T, C, H, W) with R >= T; each
    reconstruction is used at most once, and when R > T the best subset is
    chosen. The assignment minimises the summed per-image MSE (``"mse"``) or
    maximises the summed PSNR in dB (``"psnr"``, data range 1, +inf
    clipped at 100 dB).
    """
    if metric not in METRICS:
        raise ValueError(f"unknown matching metric {metric!r}; choose one of {list(METRICS)}")
    if recon.dim() != 4 or truth.dim() != 4 or recon.shape[1:] != truth.shape[1:]:
        raise ValueError(
            f"recon and truth must be (N, C, H, W) with equal image shapes; got {tuple(recon.shape)} "
            f"and {tuple(truth.shape)}"
        )
    if len(recon) < len(truth):
        raise ValueError(f"{len(recon)} reconstructions cannot cover {len(truth)} true images")
    if len(truth) == 0:
        return np.zeros(0, dtype=np.int64)
    cost = pairwise_mse(recon, truth)
    if metric == "psnr":
        cost = -clip_psnr(psnr_from_mse(cost))
    from scipy.optimize import linear_sum_assignment  # deferred: scipy adds 0.05 GB to the server process

    rows, columns = linear_sum_assignment(cost.cpu().numpy())
    return columns[np.argsort(rows)].astype(np.int64)
