"""Feature fishing across rounds (Wen et al., "Fishing for User Data in Large-Batch Federated Learning via
Gradient Magnification", ICML 2022, arXiv 2202.00580), for any model whose last layer is a Linear classifier.

Manipulation. The server keeps row ``c`` of the last layer, scaled by ``m``, zeroes every other row and sets
their biases to ``shift``; row ``c``'s bias becomes ``-m t + shift + log(K - 1)``. With ``s(x) = W_c . phi(x)``
the projection of the features on the honest row ``c``::

    p_c(x) = sigmoid(m (s(x) - t))     (exactly)

so the factor of an example at the logits, ``p_c - [y = c]``, is about ``1[s > t] - [y = c]``. Between two
models that differ only in the threshold, ``t1 < t2``, sent to one client on one batch, every gradient
differs by the gradient of the examples with ``t1 < s <= t2`` alone, each with ``dL/dz_c = +1`` (whatever its
class), divided by the batch ``B``: the difference of the two uploads is the gradient of the interval's
examples (``isolated``). Row ``c``'s bias gradient times ``B`` is the signed count
``N(t) = #{y != c, s > t} - #{y = c, s <= t}`` (``signed_count``), and ``N(t1) - N(t2) = #{t1 < s <= t2}``.

Server. ``ThresholdSearch`` places the first two thresholds at the quantiles of ``s`` over public images that
enclose ``1 / B`` of their mass, then splits or widens the probed intervals round after round from the
counts until one holds exactly one example.

Attack. With one example in the interval the difference is one image's gradient. ``isolated`` turns it into
the upload of one example labelled ``k != c`` on a surrogate model (the lower threshold's, with row ``c``'s
bias raised by ``SURE`` so ``p_c = 1`` on any input); the Inverting Gradients engine inverts it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from attackers.base import images_per_upload
from attackers.fishing import classifier
from fedguard.observation import ModelCard, Observation

SURE = 1e6  # logits added to row c's bias in the surrogate: p_c = 1 wherever m |s - t| stays below it


@dataclass(frozen=True)
class FeatureFishingParams:
    """``target``: the row ``c`` whose projection ``s`` is thresholded, 0 .. classes - 1 (fixed across rounds);
    ``threshold``: ``t``, in units of ``s``; ``scale``: ``m``, logits per unit of ``s`` (the sharper, the closer
    ``p_c`` is to a step); ``shift``: the logit of every other class."""

    target: int = 0
    threshold: float = 0.0
    scale: float = 1000.0
    shift: float = 1000.0

    def __post_init__(self) -> None:
        if self.target < 0:
            raise ValueError(f"target must be a class index >= 0, got {self.target}")
        if not math.isfinite(self.threshold):
            raise ValueError(f"threshold must be finite, got {self.threshold}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be finite and > 0, got {self.scale}")
        if not math.isfinite(self.shift):
            raise ValueError(f"shift must be finite, got {self.shift}")


class FeatureFishing:
    """The manipulation: row ``c`` times ``m``, its bias the threshold's; the other rows zero, biases ``shift``."""

    def __init__(self, params: FeatureFishingParams) -> None:
        self.params = params

    def __call__(self, arrays: list[np.ndarray], card: ModelCard, rng: np.random.Generator) -> list[np.ndarray]:
        classes, p = card.spec.num_classes, self.params
        if p.target >= classes:
            raise ValueError(f"target = {p.target} is not a class of this model; choose 0 .. {classes - 1}")
        weight, bias = classifier(arrays, card.trainable, classes)
        sent = [a.copy() for a in arrays]
        others = np.arange(classes) != p.target
        sent[weight][others] = 0
        sent[weight][p.target] *= p.scale
        sent[bias][others] = p.shift
        sent[bias][p.target] = -p.scale * p.threshold + p.shift + math.log(classes - 1)
        return sent


def build_feature_fishing(params: FeatureFishingParams) -> FeatureFishing:
    """Feature fishing (Wen et al. 2022): ``p_c`` a step at a threshold on one projection of the features. Not
    in the manipulation registry: its threshold comes from a search per client across rounds, fed by each
    round's upload, and a run's manipulations send one fixed model to every client of a round."""
    return FeatureFishing(params)


def projections(model: nn.Module, x: torch.Tensor, target: int) -> torch.Tensor:
    """``s = W_c . phi(x)`` (N,) of images ``x`` (N, C, H, W) under the honest ``model`` (eval mode), ``phi`` the
    input of its last Linear layer."""
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    features: list[torch.Tensor] = []
    hook = last.register_forward_pre_hook(lambda _, inputs: features.append(inputs[0]))
    model.eval()
    with torch.no_grad():
        model(x)
    hook.remove()
    return features[0].flatten(1) @ last.weight[target].detach()


def fished_row(obs: Observation) -> tuple[int, int, int]:
    """(row ``c``, index of the last weight, of its bias) read from the last layer the server sent; raises
    ``ValueError`` unless exactly one row is non-zero (the upload was not computed on a fished model)."""
    weight, bias = classifier(obs.global_arrays, obs.trainable, obs.spec.num_classes)
    rows = np.flatnonzero(np.any(obs.global_arrays[weight] != 0, axis=1))
    if len(rows) != 1:
        raise ValueError(
            f"the last layer {obs.names[weight]} the server sent has {len(rows)} non-zero rows, not one; "
            f"was the upload computed on a feature-fishing model?"
        )
    return int(rows[0]), weight, bias


def signed_count(obs: Observation) -> float:
    """``N(t) = B dL/db_c = #{y != c, s > t} - #{y = c, s <= t}`` of an upload on a feature-fished model."""
    target, _, bias = fished_row(obs)
    return images_per_upload(obs) * float(obs.upload[bias][target])


def interval_count(low: Observation, high: Observation) -> float:
    """``#{t1 < s <= t2}``: examples between the thresholds of two uploads of one batch, ``t1`` of ``low``."""
    return signed_count(low) - signed_count(high)


def ordered(a: Observation, b: Observation) -> tuple[Observation, Observation, int, int, int]:
    """(lower-threshold upload, higher, ``c``, weight index, bias index); raises ``ValueError`` unless both are
    one client's uploads of one batch on models that differ only in row ``c``'s bias."""
    target, weight, bias = fished_row(a)
    if (b.client, b.names, images_per_upload(b)) != (a.client, a.names, images_per_upload(a)):
        raise ValueError("the two uploads must come from one client, one model and one batch size")
    if fished_row(b)[0] != target:
        raise ValueError(f"the two uploads fished different rows: {target} and {fished_row(b)[0]}")
    for i, (x, y) in enumerate(zip(a.global_arrays, b.global_arrays)):
        if i != bias and not np.array_equal(x, y):
            raise ValueError(f"the two models sent differ in {a.names[i]}, not only in the threshold")
    if a.global_arrays[bias][target] == b.global_arrays[bias][target]:
        raise ValueError("the two models sent have the same threshold")
    low, high = (a, b) if a.global_arrays[bias][target] > b.global_arrays[bias][target] else (b, a)
    return low, high, target, weight, bias


def isolated(a: Observation, b: Observation) -> Observation:
    """The difference of two uploads of one batch at two thresholds, as the upload of one example labelled
    ``k = (c + 1) mod K`` on the surrogate: the lower threshold's model with row ``c``'s bias raised by
    ``SURE`` (``p_c = 1``). Below the last layer the difference is that example's surrogate gradient over
    ``B``; of the last layer, row ``c`` is kept, row ``k`` is its negative and the other rows zero (what the
    surrogate gives; the difference's, ``-(row c) / (K - 1)`` each, would need a soft label)."""
    low, high, target, weight, bias = ordered(a, b)
    label = (target + 1) % low.spec.num_classes
    upload = [x - y if t else x.copy() for x, y, t in zip(low.upload, high.upload, low.trainable)]
    for i in (weight, bias):
        upload[i][:] = 0
        upload[i][target] = low.upload[i][target] - high.upload[i][target]
        upload[i][label] = -upload[i][target]
    surrogate = [x.copy() for x in low.global_arrays]
    surrogate[bias][target] += SURE
    declared = {"batch-size": 1, "labels": [label]}
    return dataclasses.replace(low, global_arrays=surrogate, upload=upload, num_examples=1, declared=declared)


STEEPNESS = 1e4  # the scale m the search sends, times the spread (std) of the public projections


class ThresholdSearch:
    """The server's choice of thresholds, one a round, for one client whose batch does not change.

    Thresholds are public quantiles of ``s``, ``t = Q(u)``, probed at quantile levels ``u`` in [0, 1]. The first
    two enclose ``1 / B`` of the public mass about the median. Each round's signed count gives, with the
    neighbouring probes', how many examples lie between them; then a gap holding one example ends the search,
    else the gap holding the fewest (``k >= 2``) is split at ``1 / k`` of its mass (where one of them alone
    is likeliest), else (no example between the probes) the probed span doubles towards the side with more
    public mass.
    """

    def __init__(self, public: np.ndarray, batch: int) -> None:
        """``public``: projections ``s`` (N,) of public images; ``batch``: the client's batch size ``B``."""
        if len(public) < 2 or batch < 1:
            raise ValueError(f"need >= 2 public projections and a batch >= 1, got {len(public)} and {batch}")
        self.public = np.sort(np.asarray(public, dtype=np.float64))
        self.batch = batch
        self.probes: dict[float, int] = {}

    @property
    def scale(self) -> float:
        """``m`` to send: ``STEEPNESS`` over the public spread (logits per unit of ``s``)."""
        return STEEPNESS / max(float(self.public.std()), 1e-12)

    def threshold(self, level: float) -> float:
        """The public quantile ``Q(level)`` (units of ``s``)."""
        return float(np.quantile(self.public, level))

    def record(self, level: float, count: float) -> None:
        """The signed count ``N`` of the upload at threshold ``Q(level)``."""
        self.probes[level] = round(count)

    def gaps(self) -> list[tuple[float, float, int]]:
        """(lower level, upper level, examples between) of each pair of neighbouring probes."""
        levels = sorted(self.probes)
        return [(a, b, self.probes[a] - self.probes[b]) for a, b in itertools.pairwise(levels)]

    def found(self) -> tuple[float, float] | None:
        """The levels of two probes with exactly one example between them, or None."""
        return next(((a, b) for a, b, n in self.gaps() if n == 1), None)

    def next_level(self) -> float | None:
        """The quantile level to probe next; None once ``found`` or with nothing left to try."""
        if len(self.probes) < 2:
            half = 0.5 / self.batch
            return next(u for u in (0.5 - half, 0.5 + half) if u not in self.probes)
        if self.found():
            return None
        crowded = [(n, b - a, a, b) for a, b, n in self.gaps() if n >= 2]
        if crowded:
            n, _, a, b = min(crowded)
            return a + (b - a) / n
        low, high = min(self.probes), max(self.probes)
        span = high - low
        if low <= 0 and high >= 1:
            return None
        return min(1.0, high + span) if 1 - high >= low else max(0.0, low - span)
