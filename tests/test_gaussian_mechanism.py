"""The exact privacy profile of the Gaussian mechanism, its calibration and its composition."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm

from fedguard.defenses.gaussian_mechanism import epsilon_after, gaussian_sigma, privacy_profile


def hockey_stick(mu: float, epsilon: float) -> float:
    """sup over sets of P(S) - e^epsilon Q(S) for P = N(mu, 1), Q = N(0, 1), by quadrature on a fine grid."""
    x = np.linspace(-40.0, 40.0 + mu, 2_000_001)
    excess = np.maximum(norm.pdf(x, loc=mu) - math.exp(epsilon) * norm.pdf(x), 0.0)
    return float(np.trapezoid(excess, x))


@pytest.mark.parametrize(("mu", "epsilon"), [(0.5, 0.1), (1.0, 1.0), (2.0, 0.5), (3.0, 4.0), (0.3, 2.0)])
def test_the_profile_is_the_hockey_stick_divergence_of_two_gaussians(mu: float, epsilon: float) -> None:
    assert privacy_profile(mu, epsilon) == pytest.approx(hockey_stick(mu, epsilon), rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("epsilon", [1e15, 1e18, 1e21, 1e23])
def test_the_profile_stays_a_probability_at_huge_epsilons(epsilon: float) -> None:
    """At the worst mu (sqrt(2 epsilon)) the second term's exponent, a difference of numbers near epsilon,
    once overflowed exp() (epsilon 1e21); the profile is computed in log space."""
    for factor in (0.5, 1.0, 2.0):
        assert 0.0 <= privacy_profile(factor * math.sqrt(2 * epsilon), epsilon) <= 1.0


@pytest.mark.parametrize(
    ("epsilon", "delta", "sensitivity"), [(0.5, 1e-5, 1.0), (1.0, 1e-5, 2.0), (8.0, 1e-6, 3.0), (200.0, 1e-5, 2.0)]
)
def test_the_calibrated_sigma_is_the_smallest_that_meets_delta(
    epsilon: float, delta: float, sensitivity: float
) -> None:
    sigma = gaussian_sigma(epsilon, delta, sensitivity)
    assert privacy_profile(sensitivity / sigma, epsilon) <= delta
    assert privacy_profile(sensitivity / (sigma * (1 - 1e-6)), epsilon) > delta


@pytest.mark.parametrize("epsilon", [0.1, 0.5, 0.9])
def test_the_calibration_is_tighter_than_the_classical_bound_below_epsilon_one(epsilon: float) -> None:
    classical = math.sqrt(2 * math.log(1.25 / 1e-5)) / epsilon
    assert gaussian_sigma(epsilon, 1e-5) < classical


def test_sigma_scales_with_the_sensitivity() -> None:
    assert gaussian_sigma(1.0, 1e-5, 5.0) == pytest.approx(5 * gaussian_sigma(1.0, 1e-5, 1.0), rel=1e-8)


@pytest.mark.parametrize("epsilon", [0.3, 1.0, 10.0, 500.0])
def test_one_release_spends_the_epsilon_it_was_calibrated_for(epsilon: float) -> None:
    multiplier = gaussian_sigma(epsilon, 1e-5, 2.0)
    assert epsilon_after(1, multiplier, 2.0, 1e-5) == pytest.approx(epsilon, rel=1e-6)


def test_k_releases_spend_what_one_release_with_sqrt_k_less_noise_spends() -> None:
    assert epsilon_after(9, 6.0, 2.0, 1e-5) == pytest.approx(epsilon_after(1, 2.0, 2.0, 1e-5), rel=1e-8)
    spent = [epsilon_after(k, 6.0, 2.0, 1e-5) for k in range(1, 6)]
    assert spent == sorted(spent) and spent[0] < spent[-1]


def test_no_release_spends_nothing_and_no_noise_spends_everything() -> None:
    assert epsilon_after(0, 1.0, 2.0, 1e-5) == 0.0
    assert epsilon_after(3, 0.0, 2.0, 1e-5) == math.inf


@pytest.mark.parametrize(
    ("epsilon", "delta", "message"),
    [(0.0, 1e-5, "epsilon"), (math.inf, 1e-5, "epsilon"), (1.0, 0.0, "delta"), (1.0, 1.5, "delta")],
)
def test_bad_parameters_are_rejected_naming_them(epsilon: float, delta: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        gaussian_sigma(epsilon, delta)
