"""One call that scores a reconstructed batch against the true one."""

from __future__ import annotations

from typing import Any

import torch

from fedguard.metrics.image import clip_psnr, mse, psnr, ssim
from fedguard.metrics.labels import Labels, label_accuracy
from fedguard.metrics.lpips_offline import LPIPSUnavailable, get_lpips
from fedguard.metrics.matching import match

LEAK_SSIM = 0.9  # an image reconstructed with SSIM above this counts as leaked


def score_batch(
    recon: torch.Tensor,
    truth: torch.Tensor,
    recon_labels: Labels | None = None,
    true_labels: Labels | None = None,
    lpips_net: str = "alex",
) -> dict[str, Any]:
    """Match ``recon`` (R, C, H, W) to ``truth`` (T, C, H, W) by MSE (R >= T), then score the pairs.

    Returns ``order`` (recon index matched to each true image), the means over
    true images of ``mse``, ``psnr`` (dB; +inf clipped at 100 dB before
    averaging), ``ssim`` and ``lpips`` (None when no LPIPS weights are found,
    with the reason in ``lpips_error``), ``label_accuracy`` (multiset, order-free;
    None unless both label sets are given) and ``per_image``: one dict of
    ``mse``, ``psnr`` (unclipped: +inf for an exact copy), ``ssim`` and ``lpips``
    per true image.
    """
    if (recon_labels is None) != (true_labels is None):
        raise ValueError("give both recon_labels and true_labels, or neither")
    order = match(recon, truth, metric="mse")
    if len(truth) == 0:
        raise ValueError("truth holds no images; there is nothing to score")
    truth = truth.detach()
    paired = recon.detach()[torch.as_tensor(order, device=recon.device)].to(truth.device, truth.dtype)
    errors, peaks, structure = mse(paired, truth), psnr(paired, truth), ssim(paired, truth)
    lpips_values: list[float] | None = None
    lpips_error: str | None = None
    try:
        lpips_values = get_lpips(lpips_net)(paired, truth).tolist()
    except LPIPSUnavailable as unavailable:
        lpips_error = unavailable.reason
    per_image = [
        {
            "mse": float(errors[i]),
            "psnr": float(peaks[i]),
            "ssim": float(structure[i]),
            "lpips": None if lpips_values is None else lpips_values[i],
        }
        for i in range(len(truth))
    ]
    return {
        "order": [int(index) for index in order],
        "mse": float(errors.mean()),
        "psnr": float(clip_psnr(peaks).mean()),
        "ssim": float(structure.mean()),
        "lpips": None if lpips_values is None else sum(lpips_values) / len(lpips_values),
        "lpips_error": lpips_error,
        "label_accuracy": (
            None if true_labels is None or recon_labels is None else label_accuracy(recon_labels, true_labels)
        ),
        "per_image": per_image,
    }


def mean_colour_images(truth: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W): each true image replaced by a flat image of its own per-channel mean colour."""
    return truth.detach().mean((2, 3), keepdim=True).expand_as(truth)


def floor_scores(truth: torch.Tensor, lpips_net: str = "alex") -> dict[str, float | None]:
    """``psnr``, ``ssim``, ``lpips`` (means over images) of flat mean-colour images: what an attack must beat
    to have shown more than each image's average colour."""
    scores = score_batch(mean_colour_images(truth), truth, lpips_net=lpips_net)
    return {key: scores[key] for key in ("psnr", "ssim", "lpips")}
