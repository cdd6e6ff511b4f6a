"""The statistics of a sweep cell: exact formulas on known samples, coverage on simulated ones, degenerate cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from fedguard.report.statistics import (
    BOOTSTRAP_SEED,
    RESAMPLES,
    Summary,
    bootstrap_ci,
    over_images,
    over_seeds,
    success_rate,
    t_interval,
)

SAMPLE = [0.12, 0.85, 0.40, 0.33, 0.97, 0.05, 0.61, 0.58, 0.22, 0.74]


def test_the_bootstrap_interval_is_the_percentile_interval_of_resampled_means() -> None:
    values = np.array(SAMPLE)
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    means = values[rng.integers(0, len(values), size=(RESAMPLES, len(values)))].mean(axis=1)
    assert bootstrap_ci(values) == pytest.approx(list(np.quantile(means, [0.025, 0.975])), abs=0)
    assert bootstrap_ci(values) == bootstrap_ci(values), "the same scores give the same interval"
    assert bootstrap_ci(values, seed=1) != bootstrap_ci(values)


def test_over_images_gives_mean_median_interval_and_counts_what_it_left_out() -> None:
    summary = over_images([*SAMPLE, None, float("nan")])
    assert (summary.n, summary.missing) == (10, 2)
    assert summary.mean == pytest.approx(np.mean(SAMPLE)) and summary.median == pytest.approx(np.median(SAMPLE))
    assert summary.ci95 == bootstrap_ci(np.array(SAMPLE))
    assert summary.ci95[0] < summary.mean < summary.ci95[1]


def test_the_t_interval_is_mean_plus_minus_t_times_the_standard_error() -> None:
    accuracies = np.array([0.90, 0.88, 0.93])
    half = stats.t.ppf(0.975, 2) * accuracies.std(ddof=1) / math.sqrt(3)
    assert t_interval(accuracies) == pytest.approx([accuracies.mean() - half, accuracies.mean() + half])
    assert half == pytest.approx(4.303 * 0.02517 / math.sqrt(3), rel=1e-3)
    assert over_seeds([0.90, 0.88, 0.93]).ci95 == t_interval(accuracies)


@pytest.mark.parametrize("method", [over_images, over_seeds])
def test_one_value_has_the_interval_of_itself_and_none_has_no_statistic(method) -> None:
    assert method([0.4]) == Summary(1, 0, 0.4, 0.4, [0.4, 0.4])
    assert method([None, float("nan")]) == Summary(0, 2)
    assert method([]) == Summary(0, 0)
    assert method([0.3, 0.3, 0.3]).ci95 == pytest.approx([0.3, 0.3])


@pytest.mark.parametrize(("method", "size", "bounds"), [(over_images, 50, (0.91, 0.97)), (over_seeds, 3, (0.93, 0.97))])
def test_the_intervals_cover_a_known_mean_about_95_percent_of_the_time(method, size: int, bounds) -> None:
    """1,000 normal samples of mean 0.5: the t interval covers it 95 % of the time; the percentile bootstrap a
    little less (about 93 % at 16 to 50 values, a known bias of the method at small samples)."""
    rng = np.random.default_rng(7)
    trials = 1000
    covered = sum(low <= 0.5 <= high for low, high in (method(rng.normal(0.5, 0.2, size)).ci95 for _ in range(trials)))
    assert bounds[0] <= covered / trials <= bounds[1], covered / trials


def test_the_success_rate_is_the_share_of_finite_values_strictly_past_the_threshold() -> None:
    assert success_rate([0.2, 0.5, 0.51, 0.9, None], 0.5) == 0.5
    assert success_rate([0.1, 0.3, 0.29], 0.3, above=False) == pytest.approx(2 / 3)
    assert success_rate([None], 0.5) is None
