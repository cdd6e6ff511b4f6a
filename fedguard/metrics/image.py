"""Per-image distortion metrics: MSE, PSNR and SSIM on (N, C, H, W) batches in [0, 1]."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PSNR_CAP_DB = 100.0  # dB: where +inf PSNR (identical images) is clipped before averaging or ranking

SSIM_WINDOW = 11  # pixels: the Gaussian window of Wang et al. (2004)
SSIM_SIGMA = 1.5  # pixels
SSIM_K1 = 0.01
SSIM_K2 = 0.03


def check_pair(x: torch.Tensor, y: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``x`` and ``y`` are image batches of one shape (N, C, H, W)."""
    if x.dim() != 4 or y.dim() != 4:
        raise ValueError(f"images must be (N, C, H, W); got shapes {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape != y.shape:
        raise ValueError(f"image batches differ in shape: {tuple(x.shape)} vs {tuple(y.shape)}")


def mse(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error of each image pair over channels and pixels: (N,), in squared intensity units."""
    check_pair(x, y)
    return (x - y).pow(2).flatten(1).mean(dim=1)


def psnr(x: torch.Tensor, y: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Peak signal-to-noise ratio of each image pair in dB: (N,).

    ``10 * log10(data_range**2 / mse)``; identical images (MSE 0) give ``+inf``.
    """
    return psnr_from_mse(mse(x, y), data_range)


def psnr_from_mse(errors: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """PSNR in dB from mean squared errors (any shape): ``10 * log10(data_range**2 / errors)``, +inf at 0."""
    if not data_range > 0:
        raise ValueError(f"data_range must be positive; got {data_range}")
    return 10 * torch.log10(data_range**2 / errors)


def gaussian_window(size: int, sigma: float = SSIM_SIGMA) -> torch.Tensor:
    """A normalised ``size`` x ``size`` Gaussian window (float64), ``size`` odd."""
    offsets = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    taps = torch.exp(-(offsets**2) / (2 * sigma**2))
    taps = taps / taps.sum()
    return torch.outer(taps, taps)


def ssim(x: torch.Tensor, y: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Structural similarity of each image pair (Wang et al. 2004), averaged over channels: (N,).

    Gaussian window of 11 px with sigma 1.5 px, K1 = 0.01, K2 = 0.03, population
    (not sample) covariances, averaged over the window positions that fit inside
    the image (no padding), as scikit-image's ``structural_similarity`` with
    ``gaussian_weights=True, use_sample_covariance=False``. Images smaller than
    11 px use the largest odd window that fits (same sigma). Computed in float64,
    returned in the dtype of ``x``; 1 for identical images.
    """
    check_pair(x, y)
    if not data_range > 0:
        raise ValueError(f"data_range must be positive; got {data_range}")
    count, channels, height, width = x.shape
    size = min(SSIM_WINDOW, height, width)
    size -= 1 - size % 2
    window = gaussian_window(size).to(x.device)[None, None]

    def local_mean(image: torch.Tensor) -> torch.Tensor:
        return F.conv2d(image, window)

    a = x.to(torch.float64).reshape(count * channels, 1, height, width)
    b = y.to(torch.float64).reshape(count * channels, 1, height, width)
    mean_a, mean_b = local_mean(a), local_mean(b)
    var_a = local_mean(a * a) - mean_a**2
    var_b = local_mean(b * b) - mean_b**2
    cov = local_mean(a * b) - mean_a * mean_b
    c1 = (SSIM_K1 * data_range) ** 2
    c2 = (SSIM_K2 * data_range) ** 2
    index = ((2 * mean_a * mean_b + c1) * (2 * cov + c2)) / ((mean_a**2 + mean_b**2 + c1) * (var_a + var_b + c2))
    return index.reshape(count, channels, -1).mean(dim=2).mean(dim=1).to(x.dtype)


def clip_psnr(values: torch.Tensor) -> torch.Tensor:
    """PSNR values with ``+inf`` (and anything above) clipped to ``PSNR_CAP_DB``."""
    return values.clamp(max=PSNR_CAP_DB)
