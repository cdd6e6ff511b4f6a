"""The statistics of a sweep cell: a distribution over images, a success rate, an interval over seeds.

Over images (hundreds of scores, no assumed shape): the mean, the median and the percentile bootstrap 95 %
interval of the mean (``RESAMPLES`` resamples drawn by ``numpy.random.default_rng(BOOTSTRAP_SEED)``, so the
same scores give the same interval). Over seeds (three or so final accuracies): the Student t 95 % interval of
the mean, since a bootstrap of three values has ten distinct resample means and an interval far too narrow.
Both give ``[v, v]`` for a single value and nothing for none. A proportion (k of n, e.g. a detection rate) gets
the Wilson score 95 % interval. None and NaN values are left out of every
statistic and counted (``Summary.missing``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class Summary:
    """Statistics of one list of scores: ``n`` values used, ``missing`` (None or NaN) left out; the others are
    None when ``n`` is 0. ``ci95`` is [low, high]."""

    n: int
    missing: int
    mean: float | None = None
    median: float | None = None
    ci95: list[float] | None = None


def finite(values: Iterable[float | None]) -> tuple[np.ndarray, int]:
    """(the finite values as a float64 array, how many were None, NaN or infinite)."""
    given = list(values)
    kept = np.array([v for v in given if v is not None and math.isfinite(v)], dtype=np.float64)
    return kept, len(given) - len(kept)


def bootstrap_ci(
    values: np.ndarray, confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> list[float]:
    """Percentile bootstrap interval [low, high] of the mean of ``values`` (n,), n >= 1: the (1 - confidence) / 2
    and (1 + confidence) / 2 quantiles of the means of ``resamples`` resamples with replacement."""
    if len(values) == 1:
        return [float(values[0])] * 2
    indices = np.random.default_rng(seed).integers(0, len(values), size=(resamples, len(values)))
    means = values[indices].mean(axis=1)
    low, high = np.quantile(means, [(1 - confidence) / 2, (1 + confidence) / 2])
    return [float(low), float(high)]


def t_interval(values: np.ndarray, confidence: float = CONFIDENCE) -> list[float]:
    """Student t interval [low, high] of the mean of ``values`` (n,), n >= 1: mean +- t(n - 1) s / sqrt(n)."""
    from scipy.stats import t

    mean = float(values.mean())
    if len(values) == 1:
        return [mean, mean]
    half = float(t.ppf((1 + confidence) / 2, len(values) - 1)) * float(values.std(ddof=1)) / math.sqrt(len(values))
    return [mean - half, mean + half]


def over_images(values: Iterable[float | None]) -> Summary:
    """Mean, median and bootstrap interval of per-image scores."""
    kept, missing = finite(values)
    if not len(kept):
        return Summary(0, missing)
    return Summary(len(kept), missing, float(kept.mean()), float(np.median(kept)), bootstrap_ci(kept))


def over_seeds(values: Iterable[float | None]) -> Summary:
    """Mean, median and t interval of one figure per seed (e.g. final accuracy)."""
    kept, missing = finite(values)
    if not len(kept):
        return Summary(0, missing)
    return Summary(len(kept), missing, float(kept.mean()), float(np.median(kept)), t_interval(kept))


def success_rate(values: Iterable[float | None], threshold: float, above: bool = True) -> float | None:
    """Share of the finite ``values`` strictly above ``threshold`` (below it when ``above`` is False); None when
    there is none."""
    kept, _ = finite(values)
    if not len(kept):
        return None
    return float(np.mean(kept > threshold if above else kept < threshold))


def wilson_interval(successes: int, trials: int, confidence: float = CONFIDENCE) -> list[float]:
    """Wilson score interval [low, high] of a proportion: ``successes`` of ``trials`` (0 <= successes <= trials,
    trials >= 1); unlike the normal approximation it stays inside [0, 1] and is not empty at 0 or 1."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"a proportion needs 0 <= successes <= trials and trials >= 1, got {successes} of {trials}")
    z = NormalDist().inv_cdf((1 + confidence) / 2)
    share = successes / trials
    centre = (share + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(share * (1 - share) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return [max(0.0, centre - half), min(1.0, centre + half)]
