"""Reconstruction and gradient metrics for gradient-leakage attacks (torch, numpy and scipy only).

Images are float tensors (N, C, H, W) in [0, 1].
"""

from fedguard.metrics.gradient import cosine_similarity, gradient_psnr
from fedguard.metrics.image import mse, psnr, ssim
from fedguard.metrics.labels import label_accuracy
from fedguard.metrics.lpips_offline import LPIPSScorer, LPIPSUnavailable, get_lpips
from fedguard.metrics.matching import match
from fedguard.metrics.scoring import floor_scores, mean_colour_images, score_batch

__all__ = [
    "LPIPSScorer",
    "LPIPSUnavailable",
    "cosine_similarity",
    "floor_scores",
    "get_lpips",
    "gradient_psnr",
    "label_accuracy",
    "match",
    "mean_colour_images",
    "mse",
    "psnr",
    "score_batch",
    "ssim",
]
