"""How close an estimated gradient is to the true one; each is a list of tensors, one per parameter."""

from __future__ import annotations

import math

import torch


def flatten(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors flattened and concatenated into one float64 vector on ``device``."""
    return torch.cat([tensor.detach().to(device, torch.float64).reshape(-1) for tensor in tensors])


def flat_pair(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Both gradients flattened and concatenated to float64 vectors; ``ValueError`` on mismatched shapes."""
    if len(a) != len(b):
        raise ValueError(f"gradients hold {len(a)} and {len(b)} tensors; they must match")
    if not a:
        raise ValueError("gradients are empty")
    for index, (left, right) in enumerate(zip(a, b, strict=True)):
        if left.shape != right.shape:
            raise ValueError(f"tensor {index} differs in shape: {tuple(left.shape)} vs {tuple(right.shape)}")
    return flatten(a, a[0].device), flatten(b, a[0].device)


def cosine_similarity(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Cosine of the angle between the two concatenated gradients, in [-1, 1].

    ``ValueError`` if either is all zeros (the angle is undefined).
    """
    left, right = flat_pair(a, b)
    norms = (left.norm().item(), right.norm().item())
    if 0.0 in norms:
        raise ValueError(f"cosine similarity is undefined for a zero gradient (norms {norms[0]} and {norms[1]})")
    return max(-1.0, min(1.0, float(left @ right) / (norms[0] * norms[1])))


def gradient_psnr(estimate: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """PSNR of ``estimate`` against ``reference`` in dB: ``10 * log10(peak**2 / mse)``.

    ``peak`` is the largest absolute entry of ``reference`` and ``mse`` the mean
    squared difference over all entries of all tensors; +inf when they are equal.
    ``ValueError`` if ``reference`` is all zeros (no peak).
    """
    guess, truth = flat_pair(estimate, reference)
    peak = truth.abs().max().item()
    if peak == 0.0:
        raise ValueError("reference gradient is all zeros; its PSNR peak is undefined")
    error = (guess - truth).pow(2).mean().item()
    return math.inf if error == 0.0 else 10 * math.log10(peak**2 / error)
