"""Exact (epsilon, delta) of the Gaussian mechanism (Balle & Wang, "Improving the Gaussian Mechanism for
Differential Privacy: Analytical Calibration and Optimal Denoising", ICML 2018, Theorem 8).

Adding N(0, sigma^2 I) to a query of L2 sensitivity Delta is (epsilon, delta)-DP exactly when

    delta >= Phi(mu/2 - epsilon/mu) - e^epsilon Phi(-mu/2 - epsilon/mu),    mu = Delta / sigma

for every epsilon >= 0 (no epsilon < 1 restriction, unlike the classical sqrt(2 ln(1.25/delta)) calibration).
k releases of the same mechanism compose exactly into one with mu * sqrt(k) (Dong, Roth & Su, "Gaussian
Differential Privacy", 2022, Corollary 2), which ``epsilon_after`` uses. Both directions are solved by
bisection on the privacy profile, to a relative precision of 1e-10.
"""

from __future__ import annotations

import math
from collections.abc import Callable

_ITERATIONS = 200


def privacy_profile(mu: float, epsilon: float) -> float:
    """The smallest delta for which the Gaussian mechanism with ``mu`` = sensitivity / sigma is
    (``epsilon``, delta)-DP."""
    if mu == 0:
        return 0.0
    from scipy.special import log_ndtr  # deferred: scipy adds 0.05 GB to every client process

    log_first = float(log_ndtr(mu / 2 - epsilon / mu))
    log_second = epsilon + float(log_ndtr(-mu / 2 - epsilon / mu))  # may exceed what exp() can hold
    if not log_second < log_first:
        return 0.0
    return math.exp(log_first) * -math.expm1(log_second - log_first)  # first - second, in log space


def _check(epsilon: float | None, delta: float) -> None:
    if epsilon is not None and not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be finite and > 0, got {epsilon}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")


def _bisect(decreasing: Callable[[float], float], target: float, low: float, high: float) -> float:
    """The x in [low, high] where ``decreasing(x)`` crosses ``target``, by geometric bisection."""
    while decreasing(high) > target:
        low, high = high, high * 2
    while decreasing(low) < target and low > 1e-300:
        high, low = low, low / 2
    for _ in range(_ITERATIONS):
        middle = math.sqrt(low * high)
        if decreasing(middle) > target:
            low = middle
        else:
            high = middle
        if high / low - 1 < 1e-10:
            break
    return high


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0) -> float:
    """The smallest noise std that makes one release of a query of L2 ``sensitivity`` (epsilon, delta)-DP."""
    _check(epsilon, delta)
    if not (sensitivity > 0 and math.isfinite(sensitivity)):
        raise ValueError(f"sensitivity must be finite and > 0, got {sensitivity}")
    # the profile grows with mu: find the largest mu whose delta stays at or under the target
    mu = 1 / _bisect(lambda inverse_mu: privacy_profile(1 / inverse_mu, epsilon), delta, 0.1, 10.0)
    return sensitivity / mu


def epsilon_after(releases: int, noise_multiplier: float, sensitivity_in_clips: float, delta: float) -> float:
    """Epsilon at ``delta`` after ``releases`` uploads, each with noise std ``noise_multiplier`` * C on a query
    of sensitivity ``sensitivity_in_clips`` * C; ``inf`` for no noise, 0 before the first release."""
    _check(None, delta)
    if releases == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    mu = sensitivity_in_clips / noise_multiplier * math.sqrt(releases)
    if privacy_profile(mu, 0.0) <= delta:
        return 0.0
    return _bisect(lambda epsilon: privacy_profile(mu, epsilon), delta, 1e-3, 10.0)
