"""The condition of the conditional gradient diffusion model ("Mjölnir (Condition)", Liu et al. 2025).

SR3-style: the UNet sees x_t and a condition grid as two channels and predicts the noise of x_t. The
condition is a noisy packed gradient ``y = x + M n`` (n ~ N(0, I) per real entry, packed units, M the noise
std over the packing scale, as in ``denoise``) divided by ``sqrt(1 + M**2)``: the same rescaling that makes
y a diffusion marginal (Eq. 15). It keeps the condition's mean square near the clean signal's, whatever M
(the raw y's would grow with M**2 over the four decades of M the schedule covers), and it is the grid the
M-adaptive chain starts from. On the pattern grids of ``tests/test_mjolnir_conditional.py`` (50 epochs, M in
[0.5, 2], mean of 3 seeds) the raw y as condition denoised about as well at M = 0.5 and 1 (MSE 0.024 and
0.059 against 0.022 and 0.042) and worse at M = 2 (0.191 against 0.130, every seed).

Training (Algorithm 2 with X0 = (condition, clean)): each clean surrogate grid gets a fresh condition at
every visit, with M fixed (``noise_range`` (M, M)) or drawn per grid log-uniformly from
``noise_range`` = (M_min, M_max); only the clean channel goes through the forward diffusion. The noise of
the condition falls on the packing's real entries only (``mask``), since a packed upload is zero in its
padding. At attack time the condition is the stolen upload, packed and rescaled with its known, given or
estimated M.

Default range (0.01, 100): every M the M-adaptive start resolves, from step 0 of the linear 1000-step
schedule (M = 0.01; below about 0.007 an upload is passed on unchanged) to step 953 (M = 100, where the
signal holds 1e-4 of the rescaled upload's power, near the schedule's last alpha-bar, 4e-5), so one model
serves an attacker who estimates M. Log-uniform because M acts multiplicatively: every decade of
noise-to-signal ratio gets the same share of the training pairs. On the pattern grids the wide default
costs little against the range [0.5, 2] (MSE 0.026 / 0.054 / 0.134 against 0.022 / 0.042 / 0.130 at
M = 0.5 / 1 / 2, 50 epochs, mean of 3 seeds), so an attacker who knows the clients' noise gains a little by
training for it: a narrow range around that M, or M itself.
"""

from __future__ import annotations

import math

import torch

DEFAULT_NOISE_RANGE = (0.01, 100.0)


def check_noise_range(noise_range: tuple[float, float]) -> tuple[float, float]:
    """``noise_range`` as two floats (M_min, M_max); ``ValueError`` unless 0 < M_min <= M_max, both finite."""
    if len(noise_range) != 2:
        raise ValueError(f"noise range must be (M_min, M_max), got {noise_range!r}")
    low, high = float(noise_range[0]), float(noise_range[1])
    if not (0 < low <= high and math.isfinite(high)):
        raise ValueError(f"noise range must satisfy 0 < M_min <= M_max < inf, got ({low}, {high})")
    return low, high


def draw_noise_levels(
    noise_range: tuple[float, float], count: int, generator: torch.Generator, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """(count,) float64 noise levels M, log-uniform on ``noise_range`` (all M_min when M_min == M_max)."""
    low, high = check_noise_range(noise_range)
    u = torch.rand(count, generator=generator, device=device, dtype=torch.float64)
    return low * (high / low) ** u


def condition_of(y: torch.Tensor, noise_levels: torch.Tensor) -> torch.Tensor:
    """The condition of noisy grids ``y`` (N, 1, S, S, packed units) with noise levels M (N,): grid i divided
    by ``sqrt(1 + M_i**2)``, in ``y``'s dtype."""
    divisors = (1 + noise_levels.to(torch.float64) ** 2).sqrt().to(device=y.device, dtype=y.dtype)
    return y / divisors.reshape(-1, 1, 1, 1)


def noisy_condition(
    x0: torch.Tensor, noise_range: tuple[float, float], generator: torch.Generator, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """A training condition for each clean grid of ``x0`` (N, 1, S, S): ``x0 + M n`` with M drawn per grid
    (``draw_noise_levels``) and n ~ N(0, I) on the entries ``mask`` (bool, broadcastable to x0; all by default)
    holds, zero elsewhere, then rescaled (``condition_of``). Draws M first, then n, from ``generator``."""
    levels = draw_noise_levels(noise_range, len(x0), generator, x0.device)
    noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
    if mask is not None:
        noise = noise * mask.to(x0.device)
    return condition_of(x0 + levels.to(x0.dtype).reshape(-1, 1, 1, 1) * noise, levels)


def parse_noise_range(text: str) -> tuple[float, float]:
    """'M_MIN,M_MAX' as (M_min, M_max), or one 'M' as (M, M) (a fixed noise level); ``ValueError`` naming ``text``."""
    parts = text.split(",")
    try:
        values = [float(part) for part in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2):
        raise ValueError(
            f"noise range {text!r}: expected M or M_MIN,M_MAX (noise std over the packing scale), e.g. 0.01,100"
        )
    return check_noise_range((values[0], values[-1]))
