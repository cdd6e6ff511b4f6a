"""The edges of the imprint bins: quantiles of the server's prior on an image's mean pixel.

Three priors (``manipulation.imprint.edges``):

- ``public-normal`` (the default): the paper's (Fowl et al. 2022) normal prior ``N(mean, std)`` on the
  measurement, its mean and standard deviation those of the mean pixels of the held-out (``test``) split of a
  data set the clients do not train on: by default the run's own data set's, which the server holds (it
  evaluates the model on it); the paper takes the measurement's distribution as known to the server;
- ``normal``: the same prior with hand-set ``mean`` and ``std``;
- ``public``: the empirical distribution of those mean pixels. It puts ``1 / bins`` of the public images in
  each bin whatever the shape of their distribution (real means are skewed: MNIST digits have a long right
  tail), but with more bins than public images its edges interpolate between few order statistics, and
  ``benchmarks/malicious_batch_sizes.py`` measures it no better than ``public-normal`` on MNIST digits and
  worse on photo tiles (216 public images for 4,096 bins).

Either way the edges are ``e_0``, an edge below every measurement the prior expects (unit 0 fires for every
input), then the ``i / bins`` quantiles for ``i = 1 .. bins - 1``.
"""

from __future__ import annotations

import functools
from statistics import NormalDist

import numpy as np

from fedguard.data import SourceOptions, load_dataset

EDGES = ("normal", "public-normal", "public")
LOW_EDGE_STDS = 10.0  # e_0 = (lowest expected mean) - LOW_EDGE_STDS * (spread): below every measurement expected


def normal_edges(bins: int, mean: float, std: float) -> np.ndarray:
    """(bins,) ascending float64: ``mean - 10 std``, then the ``i / bins`` quantiles of ``N(mean, std)``."""
    prior = NormalDist(mean, std)
    inner = [prior.inv_cdf(i / bins) for i in range(1, bins)]
    return np.array([mean - LOW_EDGE_STDS * std, *inner])


def quantile_edges(bins: int, means: np.ndarray) -> np.ndarray:
    """(bins,) non-decreasing float64: ``min - 10 std`` of the public ``means`` (N,), then their ``i / bins``
    empirical quantiles (linear interpolation between order statistics)."""
    if means.ndim != 1 or len(means) < 2:
        raise ValueError(f"the public means must be a vector of 2 or more values, got shape {means.shape}")
    inner = np.quantile(means, np.arange(1, bins) / bins)
    return np.array([means.min() - LOW_EDGE_STDS * means.std(), *inner])


@functools.lru_cache(maxsize=8)
def public_means(dataset: str, source: SourceOptions = SourceOptions()) -> np.ndarray:
    """(N,) float64, read-only: the mean pixel (pixels in [0, 1]) of each image of ``dataset``'s held-out ``test``
    split, loaded with ``source``."""
    images = load_dataset(dataset, source).test.images
    means = images.flatten(1).double().mean(1).numpy() / 255.0
    means.flags.writeable = False
    return means
