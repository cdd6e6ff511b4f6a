"""Privacy spent by repeated Sampled Gaussian Mechanism steps, by Renyi differential privacy (RDP).

One DP-SGD step on a batch drawn with sampling rate ``q`` and Gaussian noise of standard deviation
``sigma * clip`` on the sum of per-sample gradients clipped to L2 norm ``clip`` is the Sampled Gaussian
Mechanism (SGM) with noise multiplier ``sigma``. Its RDP of order ``alpha`` (Mironov, Talwar and Zhang, 2019)
is, for integer ``alpha``,

    RDP(alpha) = log A_alpha / (alpha - 1),
    A_alpha = sum_{k=0}^{alpha} C(alpha, k) (1 - q)^(alpha - k) q^k exp((k^2 - k) / (2 sigma^2)),

which for ``q = 1`` is the Gaussian mechanism's ``alpha / (2 sigma^2)``. RDP adds up over steps
(``T * RDP(alpha)`` after T steps), and is converted to (epsilon, delta)-DP by Balle et al. (2020,
Theorem 21):

    epsilon = min_alpha  T RDP(alpha) + log((alpha - 1) / alpha) - (log delta + log alpha) / (alpha - 1).

Both formulas are Opacus' (``opacus.accountants.analysis.rdp``, the analysis of its ``RDPAccountant``),
imported on first use so that nothing else depends on Opacus. Every order gives a valid bound; the orders
searched are Opacus' defaults (1.1 ... 63) extended up to 1024, since little noise per step on a small
sampling rate is tightest at high orders. The result then equals Opacus' whenever its optimum lies inside
its default range, and is smaller (tighter) otherwise; Opacus' warning that the optimum is at the edge of
the searched orders is silenced, the bound being valid at any order.

The analysis assumes Poisson sampling (each sample in the batch independently with probability ``q``); a
fixed-size batch drawn without replacement, as the FedSGD client draws it, is the usual approximation.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

ORDERS: tuple[float, ...] = (
    tuple(1 + x / 10.0 for x in range(1, 100))  # Opacus' RDPAccountant.DEFAULT_ALPHAS ...
    + tuple(float(a) for a in range(12, 64))
    + (64.0, 80.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0, 768.0, 1024.0)  # ... extended to high orders
)


def _check(noise_multiplier: float, sample_rate: float, steps: int) -> None:
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise multiplier must be finite and >= 0, got {noise_multiplier}")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample rate must be in (0, 1], got {sample_rate}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")


def rdp(noise_multiplier: float, sample_rate: float, steps: int) -> np.ndarray:
    """RDP of ``steps`` SGM steps at each of ``ORDERS`` (len(ORDERS),); inf everywhere for no noise."""
    _check(noise_multiplier, sample_rate, steps)
    from opacus.accountants.analysis.rdp import compute_rdp

    return np.asarray(compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=steps, orders=list(ORDERS)))


def epsilon_spent(noise_multiplier: float, sample_rate: float, steps: int, delta: float = 1e-5) -> float:
    """The epsilon of (epsilon, ``delta``)-DP after ``steps`` SGM steps: 0 for no step, inf without noise."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    _check(noise_multiplier, sample_rate, steps)
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    from opacus.accountants.analysis.rdp import get_privacy_spent

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the")
        eps, _ = get_privacy_spent(orders=list(ORDERS), rdp=rdp(noise_multiplier, sample_rate, steps), delta=delta)
    return float(eps)
