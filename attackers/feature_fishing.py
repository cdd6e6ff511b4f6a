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
counts until one holds exactly one example. In a run the manipulation ``feature-fishing``
(``FeatureFishingServer``, a ``ClientManipulation``) freezes the model of its first round, runs one search per
node on its held-out split's projections and sends each node the model fished at its own next threshold.

Attack. With one example in the interval the difference is one image's gradient. ``isolated`` is that
difference, kept as the upload of the client's batch (the observation the server hands the attacker);
``one_example`` turns it into the upload of one example labelled ``k != c`` on a surrogate model (the lower
threshold's, with row ``c``'s bias raised by ``SURE`` so ``p_c = 1`` on any input), which the attack
``feature-fishing`` inverts with the Inverting Gradients engine.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from attackers.base import Reconstruction, class_traits, images_per_upload, register_attack
from attackers.engine.search import search
from attackers.fishing import RANDOM_CLASS, FishedSearchParams, classifier
from attackers.inverting_gradients import InvertingGradients
from attackers.manipulation import register_manipulation
from fedguard.data import load_dataset
from fedguard.models import model_at
from fedguard.observation import ModelCard, Observation
from fedguard.wire.declared import Declared

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
    """Feature fishing (Wen et al. 2022) at one threshold: ``p_c`` a step on one projection of the features. The
    registered manipulation ``feature-fishing`` (``FeatureFishingServer``) sends it to each node at the
    threshold of that node's search."""
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


ISOLATED = "isolated"  # key of ``declared`` that describes an upload ``isolated`` made


def isolated(a: Observation, b: Observation) -> Observation:
    """The difference of two uploads of one batch at two thresholds: the gradient of the one example between them,
    divided by the batch ``B``, kept as the upload of the client's batch (round: the later upload's). The lower
    threshold's model is sent with it and ``declared.extra[ISOLATED]`` holds the fished row, the surrogate's label
    ``k = (c + 1) mod K`` and the two rounds; ``one_example`` makes it the upload of that one example."""
    low, high, target, _, _ = ordered(a, b)
    label = (target + 1) % low.spec.num_classes
    upload = [x - y if t else x.copy() for x, y, t in zip(low.upload, high.upload, low.trainable)]
    about = {"row": target, "label": label, "rounds": sorted([a.round, b.round])}
    declared = low.declared.with_fields(extra={**low.declared.extra, ISOLATED: about})
    return dataclasses.replace(low, round=max(a.round, b.round), upload=upload, declared=declared)


def one_example(obs: Observation) -> Observation:
    """An ``isolated`` upload as that of one example labelled ``k`` on the surrogate: the model sent with row
    ``c``'s bias raised by ``SURE`` (``p_c = 1``). Below the last layer the difference is that example's surrogate
    gradient over ``B``; of the last layer, row ``c`` is kept, row ``k`` is its negative and the other rows zero
    (what the surrogate gives; the difference's, ``-(row c) / (K - 1)`` each, would need a soft label). Raises
    ``ValueError`` for an upload ``isolated`` did not make."""
    about = obs.declared.extra.get(ISOLATED)
    if not isinstance(about, dict):
        raise ValueError(
            f"the upload of round {obs.round}, client {obs.client} is not the difference of two feature-fishing "
            f"uploads (it declares no {ISOLATED!r}); the feature-fishing server hands over only those"
        )
    target, weight, bias = fished_row(obs)
    label = int(about["label"])
    upload = [x.copy() for x in obs.upload]
    for i in (weight, bias):
        row = upload[i][target].copy()
        upload[i][:] = 0
        upload[i][target], upload[i][label] = row, -row
    surrogate = [x.copy() for x in obs.global_arrays]
    surrogate[bias][target] += SURE
    declared = Declared(batch_size=1, labels=(label,))
    return dataclasses.replace(obs, global_arrays=surrogate, upload=upload, num_examples=1, declared=declared)


STEEPNESS = 1e4  # the scale m the search sends, times the spread (std) of the public projections


class ThresholdSearch:
    """The server's choice of thresholds, one a round, for one client whose batch does not change.

    Thresholds are public quantiles of ``s``, ``t = Q(u)``, probed at quantile levels ``u`` in [0, 1]. The first
    two enclose ``1 / B`` of the public mass about the median (the first at the median itself while ``B`` is
    unknown; then the second ``1 / B`` above it). Each round's signed count gives, with the neighbouring probes',
    how many examples lie between them; then a gap holding one example ends the search, else the gap holding
    the fewest (``k >= 2``) is split at ``1 / k`` of its mass (where one of them alone is likeliest), else (no
    example between the probes) the probed span doubles towards the side with more public mass.
    """

    def __init__(self, public: np.ndarray, batch: int | None = None, steepness: float = STEEPNESS) -> None:
        """``public``: projections ``s`` (N,) of public images; ``batch``: the client's batch size ``B``, None
        until its first upload tells (``record``); ``steepness``: ``m`` times the public spread."""
        if len(public) < 2 or (batch is not None and batch < 1):
            raise ValueError(f"need >= 2 public projections and a batch >= 1, got {len(public)} and {batch}")
        self.public = np.sort(np.asarray(public, dtype=np.float64))
        self.batch = batch
        self.steepness = steepness
        self.probes: dict[float, int] = {}

    @property
    def scale(self) -> float:
        """``m`` to send: ``steepness`` over the public spread (logits per unit of ``s``)."""
        return self.steepness / max(float(self.public.std()), 1e-12)

    def threshold(self, level: float) -> float:
        """The public quantile ``Q(level)`` (units of ``s``)."""
        return float(np.quantile(self.public, level))

    def record(self, level: float, count: float, batch: int | None = None) -> None:
        """The signed count ``N`` of the upload at threshold ``Q(level)``, and the batch ``B`` it came from."""
        self.probes[level] = round(count)
        self.batch = self.batch or batch

    def gaps(self) -> list[tuple[float, float, int]]:
        """(lower level, upper level, examples between) of each pair of neighbouring probes."""
        levels = sorted(self.probes)
        return [(a, b, self.probes[a] - self.probes[b]) for a, b in itertools.pairwise(levels)]

    def found(self) -> tuple[float, float] | None:
        """The levels of two probes with exactly one example between them, or None."""
        return next(((a, b) for a, b, n in self.gaps() if n == 1), None)

    def next_level(self) -> float | None:
        """The quantile level to probe next; None once ``found`` or with nothing left to try."""
        if not self.probes:
            return 0.5 if self.batch is None else 0.5 - 0.5 / self.batch
        if len(self.probes) == 1:
            if self.batch is None:
                raise ValueError("the batch size is still unknown after the first upload; give it to record")
            first = next(iter(self.probes))  # 0.5 - 1 / (2 B), or the median while B was unknown
            return 1 - first if first < 0.5 else min(1.0, first + 1 / self.batch)
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


@dataclass(frozen=True)
class FeatureFishingSearchParams:
    """``target``: the row ``c`` fished, 0 .. classes - 1, or -1: drawn by the server at its first round (then
    fixed); ``shift``: the logit of every other class; ``steepness``: the scale ``m`` times the spread (std) of
    the public projections (the sharper, the closer ``p_c`` is to a step)."""

    target: int = RANDOM_CLASS
    shift: float = 1000.0
    steepness: float = STEEPNESS

    def __post_init__(self) -> None:
        if self.target < RANDOM_CLASS:
            raise ValueError(f"target must be a class index >= 0 or -1 (drawn at random), got {self.target}")
        if not math.isfinite(self.shift):
            raise ValueError(f"shift must be finite, got {self.shift}")
        if not (math.isfinite(self.steepness) and self.steepness > 0):
            raise ValueError(f"steepness must be finite and > 0, got {self.steepness}")


class FeatureFishingServer:
    """The ``ClientManipulation`` of feature fishing: the model of its first round frozen, one ``ThresholdSearch``
    a node on the projections of the run's held-out split (``card.data``), each node sent that model fished at
    its own next threshold until two of its uploads enclose one example; the node is then sent the honest model.
    """

    def __init__(self, params: FeatureFishingSearchParams) -> None:
        self.params = params
        self.base: list[np.ndarray] | None = None
        self.target = params.target
        self.public = np.zeros(0)
        self.searches: dict[int, ThresholdSearch] = {}
        self.pending: dict[int, float] = {}
        """Node -> the quantile level of the model it was last sent, until its upload is learned."""
        self.uploads: dict[int, dict[float, Observation]] = {}

    def check(self, arrays: list[np.ndarray], card: ModelCard) -> None:
        """Raise ``ValueError`` unless the model has a last Linear classifier with a bias and ``target`` is a class."""
        params = FeatureFishingParams(max(self.target, 0), 0.0, 1.0, self.params.shift)
        FeatureFishing(params)(arrays, card, np.random.default_rng(0))

    def send(
        self, node: int, arrays: list[np.ndarray], card: ModelCard, rng: np.random.Generator
    ) -> list[np.ndarray] | None:
        """The frozen model fished at ``node``'s next threshold; None once its search is over."""
        if self.base is None:
            self.freeze(arrays, card, rng)
        assert self.base is not None
        search = self.searches.setdefault(node, ThresholdSearch(self.public, steepness=self.params.steepness))
        level = search.next_level()
        if level is None:
            return None
        self.pending[node] = level
        params = FeatureFishingParams(self.target, search.threshold(level), search.scale, self.params.shift)
        return FeatureFishing(params)(self.base, card, rng)

    def freeze(self, arrays: list[np.ndarray], card: ModelCard, rng: np.random.Generator) -> None:
        """Keep ``arrays`` as the model every search fishes, draw the row when ``target`` is -1, and project the
        held-out split of ``card.data`` on it."""
        if not card.data:
            raise ValueError("feature fishing projects the run's held-out split, and the model card names no data set")
        self.check(arrays, card)
        if self.target == RANDOM_CLASS:
            self.target = int(rng.integers(card.spec.num_classes))
        model = model_at(card, arrays)
        held_out = load_dataset(card.data, card.source).test
        self.public = projections(model, held_out.batch(np.arange(len(held_out)))[0], self.target).numpy()
        self.base = [a.copy() for a in arrays]

    def learn(self, node: int, obs: Observation) -> Observation | None:
        """Record the count of ``node``'s upload at its pending threshold; the ``isolated`` difference once two of
        its uploads enclose exactly one example."""
        level = self.pending.pop(node, None)
        if level is None:
            return None
        search = self.searches[node]
        search.record(level, signed_count(obs), images_per_upload(obs))
        self.uploads.setdefault(node, {})[level] = obs
        pair = search.found()
        if pair is None:
            return None
        uploads = self.uploads.pop(node)
        return isolated(uploads[pair[0]], uploads[pair[1]])


@register_manipulation("feature-fishing", params=FeatureFishingSearchParams)
def build_feature_fishing_server(params: FeatureFishingSearchParams) -> FeatureFishingServer:
    """Feature fishing across rounds (Wen et al. 2022): a threshold search per node on one feature projection,
    until two uploads of its batch differ by one example's gradient."""
    return FeatureFishingServer(params)


def has_no_batch_norm(model: nn.Module) -> None:
    """The attack's ``check_model``: the difference of two uploads is one example's gradient only when no
    BatchNorm couples the batch's examples; raises ``ValueError`` naming the first BatchNorm layer."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ValueError(
                f"feature fishing separates one example by differencing two uploads of its batch, and the "
                f"BatchNorm layer {name!r} couples the batch's examples; choose a model without BatchNorm "
                f"(lenet, mlp with batch-norm = false)"
            )


class FeatureFishingAttack:
    """Inverting Gradients on an ``isolated`` upload, as the gradient of one example on the surrogate."""

    needs: frozenset[str] = frozenset()
    needs_by_upload: Mapping[str, frozenset[str]] = {}
    uploads: frozenset[str] = frozenset({"gradient"})
    manipulation = "feature-fishing"
    check_model = staticmethod(has_no_batch_norm)

    def __init__(self, params: FishedSearchParams) -> None:
        self.params = params
        self.spec = InvertingGradients(params.inverting_gradients()).spec

    def reconstruct_many(self, observations: list[Observation], seed: int) -> list[Reconstruction]:
        """Per upload, the one inverted image in every slot of the client's batch (the evaluator pairs it with
        the true images, and the best match counts); its label is unknown: -1."""
        start = time.perf_counter()
        found = search(self.spec, [one_example(obs) for obs in observations], seed)
        seconds = (time.perf_counter() - start) / max(len(observations), 1)
        results = []
        for obs, recon in zip(observations, found):
            batch = images_per_upload(obs)
            about = obs.declared.extra[ISOLATED]
            stats = {**recon.stats, "row": about["row"], "rounds": about["rounds"], "seconds": seconds}
            images = recon.images[:1].expand(batch, *recon.images.shape[1:]).clone()
            results.append(Reconstruction(images, torch.full((batch,), -1, dtype=torch.long), stats))
        return results


@register_attack("feature-fishing", params=FishedSearchParams, traits=class_traits(FeatureFishingAttack))
def build_feature_fishing_attack(params: FishedSearchParams) -> FeatureFishingAttack:
    """Feature fishing (Wen et al. 2022): Inverting Gradients on the difference of two uploads that isolates one
    example."""
    return FeatureFishingAttack(params)
