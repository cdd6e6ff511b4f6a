"""Class fishing (Wen et al., "Fishing for User Data in Large-Batch Federated Learning via Gradient
Magnification", ICML 2022, arXiv 2202.00580), for any model whose last layer is a Linear classifier.

Manipulation. The server rewrites only the last layer, ``W`` (K, f) and ``b`` (K,): every row of a class
``k != c`` becomes zero and its bias ``shift``, the target class ``c`` keeps its row and bias::

    z_k = shift (k != c),    z_c = W_c . phi(x) + b_c

With ``shift`` far above ``z_c`` the model is sure of a class other than ``c`` on every input: ``p_c ~ 0``.
The loss gradient at the logits is ``p - e_y``; only row ``c`` reaches the features ``phi``, so the gradient of
every layer below the last is ``(p_c - [y = c]) W_c``-weighted: about ``-W_c`` for an example of class ``c``,
about zero for every other. The batch gradient of the whole feature extractor is that of the batch's
examples of class ``c`` alone (magnified against the rest by ``exp(shift - z_c)``). Every other array is sent
unchanged: the architecture, BatchNorm included, is the clients'. That holds exactly for a model without
BatchNorm (the DLG LeNet); BatchNorm on batch statistics (the ConvNet) normalizes the target with the
batch's statistics and spreads its gradient over every example of the batch, which no parameter value
undoes (``docs/explanation/attacks.md``, "Fishing").

Attack. The attacker reads ``c`` back from the last layer it sent (the class whose bias is not ``shift``)
and inverts the upload with the Inverting Gradients engine. The target bias gradient ``-(n_c / B)(1 - p_c)``
counts the examples of class ``c`` in the batch (``target_examples``). With ``images = "one"`` (the paper's)
the upload is inverted as the gradient of one example of class ``c``: more than one and the inverted image is
their mixture. With ``images = "counted"`` it is inverted as the gradient of a batch of ``n = round(n_c)``
examples all of class ``c`` (at least 1, at most ``max_images``): below the last layer the fished gradient is
exactly theirs, scaled by ``n / B`` (the mean loss divides by ``B`` where the dummy batch divides by ``n``),
which the search's cosine does not see. Of the last layer's gradient only row ``c`` is about the target
examples; the rows of the other classes mix every example of the batch, so the attack replaces them with what
examples of class ``c`` give there (``p_k = (1 - p_c) / (K - 1)`` for every ``k != c``): ``-(row c) / (K - 1)``,
the same for any ``n`` and exact for the dummy images the search compares with. The reconstruction fills every
slot of the batch with the inverted images in turn (the evaluator's matching then pairs each with the true
images, and the best match counts; a flat fill would pair with flat true tiles); every slot is labelled ``c``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from attackers.base import Reconstruction, class_traits, images_per_upload, register_attack
from attackers.engine.search import search
from attackers.engine.spec import SearchSpec
from attackers.inverting_gradients import InvertingGradients, InvertingGradientsParams
from attackers.labels import last_layer
from attackers.manipulation import register_manipulation
from fedguard.observation import ModelCard, Observation
from fedguard.wire.declared import Declared

RANDOM_CLASS = -1  # ``target`` value: the server draws the target class uniformly at each sending


def classifier(arrays: list[np.ndarray], trainable: tuple[bool, ...], classes: int) -> tuple[int, int]:
    """``state_dict`` indices (weight (K, f), bias (K,)) of the last trainable Linear layer with ``classes``
    outputs; raises ``ValueError`` naming the model's shapes when it has no such layer with a bias."""
    kept = [i for i, t in enumerate(trainable) if t]
    try:
        weight, bias = last_layer([torch.from_numpy(np.asarray(arrays[i])) for i in kept], classes)
    except ValueError as missing:
        raise ValueError(f"fishing needs a last Linear layer with {classes} outputs: {missing}") from None
    if weight is None or bias is None:
        shapes = [tuple(arrays[i].shape) for i in kept]
        raise ValueError(f"fishing needs a last Linear layer with {classes} outputs and a bias; shapes {shapes}")
    return kept[weight], kept[bias]


@dataclass(frozen=True)
class FishingParams:
    """``target``: the class fished, 0 .. classes - 1, or -1: drawn uniformly by the server each time it sends
    the model (it does not know the clients' batches); ``shift``: the logit of every other class (logit units;
    1000, as in the paper's code (breaching), puts ``p_c`` below ``exp(-900)`` on any input of a model whose
    logits stay under 100)."""

    target: int = RANDOM_CLASS
    shift: float = 1000.0

    def __post_init__(self) -> None:
        if self.target < RANDOM_CLASS:
            raise ValueError(f"target must be a class index >= 0 or -1 (drawn at random), got {self.target}")
        if not (np.isfinite(self.shift) and self.shift > 0):
            raise ValueError(f"shift must be finite and > 0, got {self.shift}")


class Fishing:
    """The manipulation: the last layer's other-class rows zeroed and their biases set to ``shift``."""

    def __init__(self, params: FishingParams) -> None:
        self.params = params

    def __call__(self, arrays: list[np.ndarray], card: ModelCard, rng: np.random.Generator) -> list[np.ndarray]:
        classes = card.spec.num_classes
        target = int(rng.integers(classes)) if self.params.target == RANDOM_CLASS else self.params.target
        if target >= classes:
            raise ValueError(f"target = {target} is not a class of this model; choose 0 .. {classes - 1} or -1")
        weight, bias = classifier(arrays, card.trainable, classes)
        sent = [a.copy() for a in arrays]
        others = np.arange(classes) != target
        sent[weight][others] = 0
        sent[bias][others] = self.params.shift
        return sent


@register_manipulation("fishing", params=FishingParams)
def build_fishing(params: FishingParams) -> Fishing:
    """Class fishing (Wen et al. 2022): every class but one made certain, so its examples alone leave gradient."""
    return Fishing(params)


def fished_class(obs: Observation) -> tuple[int, int, int]:
    """(target class, index of the last weight, of its bias) read from the last layer the server sent; raises
    ``ValueError`` unless every other class's row is zero (the upload was not computed on a fished model)."""
    weight, bias = classifier(obs.global_arrays, obs.trainable, obs.spec.num_classes)
    sent_weight, sent_bias = obs.global_arrays[weight], obs.global_arrays[bias]
    target = int(np.argmin(sent_bias))
    others = np.arange(len(sent_bias)) != target
    if np.any(sent_weight[others] != 0):
        raise ValueError(
            f"the last layer {obs.names[weight]} the server sent has non-zero rows outside class {target}; "
            f"was the upload computed on a fishing model?"
        )
    return target, weight, bias


def target_examples(obs: Observation) -> float:
    """How many examples of the fished class the batch held: ``-B * dL/db_c``, (1 - p_c) taken as 1."""
    target, _, bias = fished_class(obs)
    return -images_per_upload(obs) * float(obs.upload[bias][target])


def as_target_examples(obs: Observation, examples: int) -> tuple[Observation, int]:
    """(``obs`` as the upload of ``examples`` examples of the fished class, that class): the last layer's rows
    of the other classes replaced by ``-(row c) / (K - 1)``, the batch size and labels declared."""
    target, weight, bias = fished_class(obs)
    upload = [a.copy() for a in obs.upload]
    others = np.arange(obs.spec.num_classes) != target
    share = 1.0 / (obs.spec.num_classes - 1)
    upload[weight][others] = -share * upload[weight][target]
    upload[bias][others] = -share * upload[bias][target]
    declared = Declared(batch_size=examples, labels=(target,) * examples)
    return dataclasses.replace(obs, upload=upload, num_examples=examples, declared=declared), target


def trains_on_one_example(model: nn.Module) -> None:
    """The attack's ``check_model``: the search runs the model in training mode on one image, which a
    BatchNorm1d (one value per channel) refuses; raises ``ValueError`` naming the first such layer."""
    for name, module in model.named_modules():
        if isinstance(module, nn.BatchNorm1d):
            raise ValueError(
                f"fishing inverts the upload as the gradient of one example, and the BatchNorm1d layer {name!r} "
                f"cannot train on one (one value per channel); choose a model without BatchNorm1d "
                f"(lenet, convnet, mlp with batch-norm = false)"
            )


IMAGES = ("one", "counted")  # ``images``: what the fished gradient is inverted as


@dataclass(frozen=True)
class FishedSearchParams:
    """The Inverting Gradients search run on a fished gradient (``attackers.inverting_gradients``):
    ``iterations``: signed-Adam iterations; ``restarts``: random starts per upload, the best kept; ``lr``: step
    on [0, 1] pixels; ``tv``: weight of the total-variation prior; ``device``: 'auto', 'cpu' or 'cuda';
    ``compile``: 'auto', 'on' or 'off'; ``schedule``: 'step' (the paper's), 'cosine' or 'none'."""

    iterations: int = 2000
    restarts: int = 1
    lr: float = 0.025
    tv: float = 0.01
    device: str = "auto"
    compile: str = "auto"
    schedule: str = "step"

    def __post_init__(self) -> None:
        self.inverting_gradients()

    def inverting_gradients(self) -> InvertingGradientsParams:
        """The IG parameters these stand for (checked there)."""
        search = {f.name: getattr(self, f.name) for f in dataclasses.fields(FishedSearchParams)}
        return InvertingGradientsParams(**search)


@dataclass(frozen=True)
class FishingAttackParams(FishedSearchParams):
    """The search of ``FishedSearchParams``, and ``images``: 'one' (the paper's: the gradient of one example of
    the fished class) or 'counted' (of as many examples as the bias gradient counts); ``max_images``: the most
    examples 'counted' inverts."""

    images: str = "one"
    max_images: int = 8

    def examples(self, counted: float) -> int:
        """How many examples the fished gradient is inverted as, given the count of the target class's."""
        if self.images == "one":
            return 1
        return min(max(round(counted), 1), self.max_images)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.images not in IMAGES:
            raise ValueError(f"images {self.images!r}: choose one of {', '.join(IMAGES)}")
        if self.max_images < 1:
            raise ValueError(f"max-images must be >= 1, got {self.max_images}")


class FishingAttack:
    """Inverting Gradients on the fished gradient, as that of one (or the counted) examples of the target class."""

    needs: frozenset[str] = frozenset()
    needs_by_upload: Mapping[str, frozenset[str]] = {}
    uploads: frozenset[str] = frozenset({"gradient"})
    manipulation = "fishing"
    check_model = staticmethod(trains_on_one_example)

    def __init__(self, params: FishingAttackParams) -> None:
        self.params = params
        self.spec = InvertingGradients(params.inverting_gradients()).spec

    def reconstruct_many(self, observations: list[Observation], seed: int) -> list[Reconstruction]:
        """Per upload, its inverted images in turn in every slot; uploads inverted as equally many examples
        are searched together from the starting points ``seed`` gives."""
        start = time.perf_counter()
        counts = [target_examples(obs) for obs in observations]
        fished = [as_target_examples(obs, self.params.examples(count)) for obs, count in zip(observations, counts)]
        found = searched_by_size([sub for sub, _ in fished], self.spec, seed)
        seconds = (time.perf_counter() - start) / max(len(observations), 1)
        results = []
        for obs, count, (sub, target), recon in zip(observations, counts, fished, found):
            batch = images_per_upload(obs)
            stats: dict[str, Any] = {
                **recon.stats,
                "target_class": target,
                "target_examples": round(count, 3),
                "images_inverted": sub.num_examples,
                "seconds": seconds,
            }
            images = recon.images[torch.arange(batch) % sub.num_examples]
            labels = torch.full((batch,), target, dtype=torch.long)
            results.append(Reconstruction(images, labels, stats))
        return results


def searched_by_size(observations: list[Observation], spec: SearchSpec, seed: int) -> list[Reconstruction]:
    """``search`` of each observation, those with one batch size together, in the order given."""
    found: dict[int, Reconstruction] = {}
    for size in sorted({obs.num_examples for obs in observations}):
        group = [i for i, obs in enumerate(observations) if obs.num_examples == size]
        found.update(zip(group, search(spec, [observations[i] for i in group], seed)))
    return [found[i] for i in range(len(observations))]


@register_attack("fishing", params=FishingAttackParams, traits=class_traits(FishingAttack))
def build_fishing_attack(params: FishingAttackParams) -> FishingAttack:
    """Fishing (Wen et al. 2022): Inverting Gradients on a class-fished gradient, as one example or the counted ones."""
    return FishingAttack(params)
