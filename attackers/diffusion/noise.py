"""The noise level M of Mjölnir's M-adaptive process, from what the attacker knows or from the noisy gradient.

Units. The diffusion model is trained on packed gradients divided by a fixed
``scale`` s (raw = s * normalized), so the perturbation of Eq. 14,
``grad' = grad + M N(0, I)``, must be written in those units too: a raw
per-entry noise std sigma gives ``M = sigma / s``. The identity of Eq. 15 is
scale-covariant (``grad'/s = grad/s + (sigma/s) N(0, I)``), but the reverse
chain only denoises well on inputs distributed like its training grids. With
grids normalized to unit RMS, M is the noise-to-signal ratio of RMS values.
Every helper takes ``scale`` (default 1: raw units) and returns M as a float.

Laplace noise. The reverse chain is derived for Gaussian noise; the paper runs
the same process on Laplace-perturbed gradients (its Fig. 6) without saying
which M it uses. Here M is the Laplace standard deviation sqrt(2) * b: the
rescaled input then has the mean and per-entry variance of the diffusion
marginal at the start step, though not its Gaussian shape.
"""

from __future__ import annotations

import math

import torch


def _check_positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and > 0, got {value}")


def _check_non_negative(name: str, value: float) -> None:
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and >= 0, got {value}")


def noise_level(std: float, scale: float = 1.0) -> float:
    """M of Gaussian noise with per-entry standard deviation ``std`` (raw units): ``std / scale``."""
    _check_non_negative("noise std", std)
    _check_positive("scale", scale)
    return std / scale


def noise_level_dp(noise_multiplier: float, clip: float, scale: float = 1.0) -> float:
    """M of the Gaussian mechanism of ``fedguard.defenses.dp_update``: ``noise_multiplier * clip / scale``."""
    _check_non_negative("noise multiplier", noise_multiplier)
    _check_positive("clip", clip)
    return noise_level(noise_multiplier * clip, scale)


def classical_gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """Classical Gaussian-mechanism std ``sqrt(2 ln(1.25 / delta)) * sensitivity / epsilon`` (paper Eq. 6).

    The (epsilon, delta) guarantee of this calibration holds for epsilon < 1 only; larger values are accepted as a
    noise calibration, as in the paper's experiments (epsilon up to 10). The ``dp`` defense's ``epsilon`` uses the
    exact analytic calibration by default (``fedguard.defenses.gaussian_mechanism``), or this formula with the
    published code's sensitivity 0.02 under ``calibration = "mjolnir-code"``; ``noise-source = defense`` reads the
    noise it really adds."""
    _check_positive("epsilon", epsilon)
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    _check_non_negative("sensitivity", sensitivity)
    return math.sqrt(2 * math.log(1.25 / delta)) * sensitivity / epsilon


def noise_level_epsilon(epsilon: float, delta: float, sensitivity: float, scale: float = 1.0) -> float:
    """M of the Gaussian mechanism calibrated to (``epsilon``, ``delta``) for L2 ``sensitivity`` (raw units)."""
    return noise_level(classical_gaussian_sigma(epsilon, delta, sensitivity), scale)


def noise_level_laplace(b: float, scale: float = 1.0) -> float:
    """M of Laplace noise of scale ``b`` (raw units): its standard deviation ``sqrt(2) * b / scale``."""
    _check_non_negative("Laplace scale b", b)
    return noise_level(math.sqrt(2) * b, scale)


def noise_level_from_c(c: float) -> float:
    """The M whose rescaling factor ``1 / sqrt(1 + M**2)`` is ``c`` in (0, 1]: the non-adaptive variant's fixed c."""
    if not 0 < c <= 1:
        raise ValueError(f"c must be in (0, 1], got {c}")
    return math.sqrt(1 / c**2 - 1)


def estimate_noise_level(y: torch.Tensor, signal_power: float, mask: torch.Tensor | None = None) -> float:
    """M estimated from noisy grids ``y`` (N, 1, S, S, normalized units) when the noise parameters are unknown.

    With zero-mean noise independent of the gradient, ``E[y**2] = E[x**2] + M**2``. ``signal_power`` is the mean
    square of the clean grids in the same units, taken from the training set (1 for grids normalized to unit RMS);
    the estimate is ``sqrt(max(mean(y**2) - signal_power, 0))`` over the entries selected by ``mask`` (bool,
    broadcastable to ``y``; e.g. the unpadded entries), all of ``y`` by default. It assumes the attacked gradients
    carry the training set's power: a clean gradient stronger or weaker than that shifts ``M**2`` by the
    difference, so the estimate is coarse for M**2 well below the spread of gradient powers (and 0 when the
    noisy power falls below ``signal_power``)."""
    _check_non_negative("signal power", signal_power)
    values = y if mask is None else y[mask.expand_as(y)]
    if values.numel() == 0:
        raise ValueError("no entries to estimate the noise level from: y or its mask is empty")
    return math.sqrt(max(float(values.double().pow(2).mean()) - signal_power, 0.0))
