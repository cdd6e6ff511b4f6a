"""Trap weights (Boenisch et al., "When the Curious Abandon Honesty", EuroS&P 2023, arXiv 2112.02918).

Manipulation. The server rewrites the first Linear layer on the flattened image, ``W`` (n, d) and ``b`` (n,),
``d = C*H*W``, row by row as the paper does::

    w_i ~ N(0, sigma^2 I_d),    w_ij <- s * w_ij  where w_ij > 0,    b_i = bias    (0 < s <= 1)

Pixels are non-negative, so a row whose positive part is shrunk by ``s`` (``scale_factor``; the paper uses
values just below 1) has a negative response ``w_i . x + b_i`` for most inputs ``x``: each ReLU unit fires
for few inputs of a batch. With ``bias = 0`` (the paper's choice) shrinking the positive part by ``s`` and
growing the negative part by ``1 / s`` trap the same inputs. Every other array is sent unchanged.

Attack. With ``h = ReLU(W x + b)`` the batch-mean gradient of unit i is::

    dL/dW_i = (1/B) sum_k delta_ik x_k,    dL/db_i = (1/B) sum_k delta_ik,    delta_ik = 0 unless x_k fires unit i

so ``x_i = (dL/dW_i) / (dL/db_i)`` is exactly ``x_k`` when ``x_k`` alone fires unit i, and a mixture of the
inputs that fire it otherwise. One input that fires several units alone gives one and the same candidate at
each of them; a mixture's weights ``delta_ik`` differ from unit to unit, and so do its candidates.

Selection rule: candidates whose RMS difference is at most ``tolerance`` form one group (greedy, in unit
order); groups are ranked by (multiplicity >= 2, inside the pixel box [0, 1] up to ``tolerance``,
multiplicity, first unit) and the B best give the images (their members' mean). Groups of multiplicity >= 2
inside the box are counted as recovered (believed pure) and come first; a pure input that fires only one unit
alone is returned when slots remain but cannot be told from a mixture. Empty slots get a flat 0.5 image.

The helpers below (first layer, its gradient, labels, image assembly) serve every first-layer attack.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attackers.base import Reconstruction, class_traits, images_per_upload, register_attack
from attackers.engine.problem import target_update
from attackers.labels import declared_labels, upload_labels_inferred
from attackers.manipulation import register_manipulation
from fedguard.data.spec import DataSpec
from fedguard.observation import ModelCard, Observation

TINY = 1e-10  # a unit whose |dL/db_i| is below TINY * max_j |dL/db_j| counts as silent
FILL = 0.5  # pixel value of an image slot left without a candidate


def input_layer(
    names: Sequence[str], trainable: Sequence[bool], shapes: Sequence[tuple[int, ...]], spec: DataSpec
) -> int:
    """Index of the first trainable weight (units, C*H*W) followed by its bias (units,): the Linear layer on the
    flattened image. Raises ``ValueError`` naming the model's entries when there is none."""
    pixels = spec.channels * spec.height * spec.width
    for i in range(len(names) - 1):
        shape = tuple(shapes[i])
        if (
            trainable[i]
            and trainable[i + 1]
            and len(shape) == 2
            and shape[1] == pixels
            and tuple(shapes[i + 1]) == (shape[0],)
        ):
            return i
    entries = ", ".join(f"{n} {tuple(s)}" for n, s in zip(names, shapes))
    raise ValueError(
        f"no trainable Linear layer with bias on the flattened {'x'.join(map(str, spec.shape))} image "
        f"(weight of shape (units, {pixels})) among the model's entries: {entries}"
    )


def card_input_layer(arrays: list[np.ndarray], card: ModelCard) -> int:
    """``input_layer`` of the model ``card`` describes, whose ``state_dict`` arrays are ``arrays``."""
    return input_layer(card.names, card.trainable, [a.shape for a in arrays], card.spec)


def first_layer_gradient(obs: Observation) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(index of the input layer's weight, its gradient (units, d), its bias gradient (units,)), float64."""
    if obs.kind != "gradient":
        raise ValueError(f"this attack needs FedSGD gradients, got a {obs.kind!r} upload")
    return first_layer_update(obs)


def first_layer_update(obs: Observation) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(index of the input layer's weight, its update (units, d), its bias update (units,)), float64: the batch
    gradient of a 'gradient' upload, the model difference ``global - uploaded`` of a 'weights' upload (``lr``
    times the sum of the local steps' gradients)."""
    index = input_layer(obs.names, obs.trainable, [a.shape for a in obs.global_arrays], obs.spec)
    weight, bias = (torch.tensor(obs.upload[i], dtype=torch.float64) for i in (index, index + 1))
    if obs.kind == "weights":
        weight = torch.tensor(obs.global_arrays[index], dtype=torch.float64) - weight
        bias = torch.tensor(obs.global_arrays[index + 1], dtype=torch.float64) - bias
    return index, weight, bias


def upload_labels(obs: Observation, batch: int) -> tuple[torch.Tensor, bool]:
    """(labels (batch,) int64, whether inferred): the declared ones, else inferred from the last layer's gradient
    (or model difference, for a 'weights' upload)."""
    declared = declared_labels(obs.declared)
    if declared is not None:
        return declared, False
    return upload_labels_inferred(obs, target_update(obs, torch.device("cpu")), batch), True


def in_box(candidates: torch.Tensor, slack: float) -> torch.Tensor:
    """(n,) True where every pixel of a flattened candidate (n, d) lies in [-slack, 1 + slack]."""
    return ((candidates >= -slack) & (candidates <= 1 + slack)).all(1)


def as_images(picked: list[torch.Tensor], batch: int, spec: DataSpec) -> torch.Tensor:
    """(batch, C, H, W) float32 in [0, 1]: the flattened ``picked`` images, then flat 0.5 images."""
    images = torch.full((batch, *spec.shape), FILL, dtype=torch.float32)
    for slot, image in enumerate(picked[:batch]):
        images[slot] = image.reshape(spec.shape).clamp(0, 1).to(torch.float32)
    return images


@dataclass(frozen=True)
class TrapWeightsParams:
    """Trap rows of the first layer. ``sigma``: standard deviation of the trap rows' weights, N(0, sigma) per
    pixel; ``scale_factor``: s in (0, 1], the factor of the trap rows' positive part; ``bias``: the trap rows'
    bias (0 in the paper)."""

    sigma: float = 0.01
    scale_factor: float = 0.95
    bias: float = 0.0

    def __post_init__(self) -> None:
        if not self.sigma > 0:
            raise ValueError(f"sigma must be > 0, got {self.sigma}")
        if not 0 < self.scale_factor <= 1:
            raise ValueError(f"scale_factor must be in (0, 1], got {self.scale_factor}")
        if not np.isfinite(self.bias):
            raise ValueError(f"bias must be finite, got {self.bias}")


class TrapWeights:
    """The manipulation: trap rows in the first Linear layer, every other array unchanged (copied)."""

    def __init__(self, params: TrapWeightsParams) -> None:
        self.params = params

    def __call__(self, arrays: list[np.ndarray], card: ModelCard, rng: np.random.Generator) -> list[np.ndarray]:
        index = card_input_layer(arrays, card)
        weight = rng.normal(0.0, self.params.sigma, size=arrays[index].shape)
        weight[weight > 0] *= self.params.scale_factor
        sent = [a.copy() for a in arrays]
        sent[index] = weight.astype(arrays[index].dtype)
        sent[index + 1] = np.full_like(arrays[index + 1], self.params.bias)
        return sent


@register_manipulation("trap-weights", params=TrapWeightsParams)
def build_trap_weights(params: TrapWeightsParams) -> TrapWeights:
    """Trap weights (Boenisch et al. 2023): first-layer rows that few inputs activate."""
    return TrapWeights(params)


@dataclass(frozen=True)
class TrapReadoutParams:
    """``tolerance``: RMS pixel difference (pixels in [0, 1]) within which two candidates are one image, also
    the slack of the pixel-box test."""

    tolerance: float = 1e-4

    def __post_init__(self) -> None:
        if not self.tolerance > 0:
            raise ValueError(f"tolerance must be > 0, got {self.tolerance}")


def group_candidates(candidates: torch.Tensor, tolerance: float) -> list[torch.Tensor]:
    """Member indices of each group of near-identical candidates (n, d) (RMS difference <= tolerance), greedy in
    index order."""
    close = torch.cdist(candidates, candidates) <= tolerance * candidates.shape[1] ** 0.5
    close.fill_diagonal_(True)
    free = torch.ones(len(candidates), dtype=torch.bool)
    groups = []
    for i in range(len(candidates)):
        if free[i]:
            members = torch.nonzero(close[i] & free).flatten()
            free[members] = False
            groups.append(members)
    return groups


class TrapWeightsAttack:
    """Closed-form read-out of the inputs trapped by single first-layer units."""

    needs: frozenset[str] = frozenset()
    needs_by_upload: Mapping[str, frozenset[str]] = {}
    uploads: frozenset[str] = frozenset({"gradient"})
    manipulation = "trap-weights"

    def __init__(self, params: TrapReadoutParams) -> None:
        self.params = params

    def reconstruct_one(self, obs: Observation) -> Reconstruction:
        """The inputs behind one gradient upload of a trap-weights model."""
        start = time.perf_counter()
        batch = images_per_upload(obs)
        _, weight_grad, bias_grad = first_layer_gradient(obs)
        scale = float(bias_grad.abs().max())
        active = torch.nonzero(bias_grad.abs() > TINY * scale).flatten()
        candidates = weight_grad[active] / bias_grad[active, None]
        groups = group_candidates(candidates, self.params.tolerance)
        images = [candidates[g].mean(0) for g in groups]
        boxed = [bool(in_box(image[None], self.params.tolerance)) for image in images]
        ranked = sorted(
            range(len(groups)), key=lambda j: (len(groups[j]) < 2, not boxed[j], -len(groups[j]), int(groups[j][0]))
        )[:batch]
        labels, inferred = upload_labels(obs, batch)
        stats: dict[str, Any] = {
            "recovered": sum(len(groups[j]) >= 2 and boxed[j] for j in ranked),
            "candidates": len(groups),
            "active_neurons": len(active),
            "labels_inferred": inferred,
            "seconds": time.perf_counter() - start,
        }
        return Reconstruction(as_images([images[j] for j in ranked], batch, obs.spec), labels, stats)

    def reconstruct_many(self, observations: list[Observation], seed: int) -> list[Reconstruction]:
        """``reconstruct_one`` of each upload (closed form: nothing to batch, nothing random: ``seed`` unused)."""
        return [self.reconstruct_one(obs) for obs in observations]


@register_attack("trap-weights", params=TrapReadoutParams, traits=class_traits(TrapWeightsAttack))
def build_trap_weights_attack(params: TrapReadoutParams) -> TrapWeightsAttack:
    """Trap weights (Boenisch et al. 2023): inputs read off first-layer units that one input alone activates."""
    return TrapWeightsAttack(params)
