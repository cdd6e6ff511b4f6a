"""The pieces of an optimization attack's objective: gradient distances and priors, each registered by name.

A distance compares each job's dummy gradient with its target, per trainable
parameter (J, ...) each, and returns (J,). A prior scores each job's dummy
images and search variable (J,) from the ``TermInputs`` of one evaluation.
Presets (``attackers.engine.presets``) combine them with weights. A plugin adds
its own with ``register_distance`` and ``register_prior``; a ``SearchSpec``
then names them as it names the built-in ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, cast

import torch

Distance = Callable[[list[torch.Tensor], list[torch.Tensor]], torch.Tensor]
DISTANCES: dict[str, Distance] = {}
Named = TypeVar("Named", bound=Callable[..., torch.Tensor])


def adder(kind: str, table: dict[str, Named], name: str) -> Callable[[Named], Named]:
    """A decorator that enters its function in ``table`` under ``name``; ``ValueError`` for a name taken."""

    def add(term: Named) -> Named:
        if name in table:
            raise ValueError(f"{kind} {name!r} is registered already ({table[name].__module__})")
        table[name] = term
        return term

    return add


def register_distance(name: str) -> Callable[[Distance], Distance]:
    """Register the decorated gradient distance under ``name`` (``SearchSpec.distance``); raises ``ValueError`` for
    a name taken."""
    return adder("distance", DISTANCES, name)


def dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """Per-job inner product over every parameter: (J, ...) lists -> (J,)."""
    return cast(torch.Tensor, sum((x.flatten(1) * y.flatten(1)).sum(1) for x, y in zip(a, b)))


@register_distance("cosine")
def cosine_distance(g: list[torch.Tensor], target: list[torch.Tensor]) -> torch.Tensor:
    """``1 - cos(g, target)`` per job, every parameter as one vector (Inverting Gradients)."""
    return 1 - dot(g, target) / (torch.sqrt(dot(g, g)) * torch.sqrt(dot(target, target)) + 1e-12)


@register_distance("l2")
def l2_distance(g: list[torch.Tensor], target: list[torch.Tensor]) -> torch.Tensor:
    """Squared Euclidean distance per job (DLG)."""
    return cast(torch.Tensor, sum(((x - y).flatten(1) ** 2).sum(1) for x, y in zip(g, target)))


@register_distance("relative-l2")
def relative_l2_distance(g: list[torch.Tensor], target: list[torch.Tensor]) -> torch.Tensor:
    """Squared Euclidean distance over the target's squared norm (1 for a zero dummy gradient; GradInversion)."""
    return l2_distance(g, target) / dot(target, target).clamp_min(1e-12)


Statistics = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class TermInputs:
    """What a prior may look at in one evaluation: dummy ``images`` (J, B, C, H, W) in [0, 1], the search
    variable ``z`` (J, ...), each job's BatchNorm input ``statistics`` and their ``bn_target`` ((J, C) mean and
    variance per layer; empty unless a term asks), ``restarts`` (jobs of one upload are consecutive) and
    ``copies``: how many copies of the client's examples the images hold, one after the other (one per local
    epoch when the shuffle is searched, ``attackers.engine.spaces.EpochCopiesSpace``)."""

    images: torch.Tensor
    z: torch.Tensor
    statistics: Statistics
    bn_target: Statistics
    restarts: int
    copies: int = 1


Prior = Callable[[TermInputs], torch.Tensor]
PRIORS: dict[str, Prior] = {}


def register_prior(name: str) -> Callable[[Prior], Prior]:
    """Register the decorated prior under ``name`` (``Term.name``); raises ``ValueError`` for a name taken."""
    return adder("prior", PRIORS, name)


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of neighbouring pixels of images (..., C, H, W) -> (...)."""
    dx = (x[..., :, :, 1:] - x[..., :, :, :-1]).abs().mean((-3, -2, -1))
    dy = (x[..., :, 1:, :] - x[..., :, :-1, :]).abs().mean((-3, -2, -1))
    return dx + dy


@register_prior("tv")
def tv_prior(inputs: TermInputs) -> torch.Tensor:
    """Total variation, averaged over each job's batch."""
    return total_variation(inputs.images).mean(1)


@register_prior("l2")
def grey_prior(inputs: TermInputs) -> torch.Tensor:
    """Mean squared distance of the pixels to mid-grey (the l2 image prior on [0, 1] pixels)."""
    return ((inputs.images - 0.5) ** 2).flatten(1).mean(1)


@register_prior("bn")
def batch_norm_prior(inputs: TermInputs) -> torch.Tensor:
    """Sum over BatchNorm layers of ``||mu(x) - mu||_2 + ||var(x) - var||_2`` per job."""
    return sum(
        torch.linalg.vector_norm(mean - mean_t, dim=1) + torch.linalg.vector_norm(var - var_t, dim=1)
        for (mean, var), (mean_t, var_t) in zip(inputs.statistics, inputs.bn_target)
    )


@register_prior("running-stats")
def running_statistics_prior(inputs: TermInputs) -> torch.Tensor:
    """Per job, the squared error of the running statistics' change a FedAvg replay makes against the uploaded
    one, relative to the uploaded change's squared norm, summed over the mean and the variance of every
    BatchNorm layer (``attackers.bn_statistics.running_change``)."""
    return cast(
        torch.Tensor,
        sum(
            ((mean - mean_t) ** 2).sum(1) / (mean_t**2).sum(1).clamp_min(1e-12)
            + ((var - var_t) ** 2).sum(1) / (var_t**2).sum(1).clamp_min(1e-12)
            for (mean, var), (mean_t, var_t) in zip(inputs.statistics, inputs.bn_target)
        ),
    )


@register_prior("group")
def group_prior(inputs: TermInputs) -> torch.Tensor:
    """Mean squared distance of each job's images to the (detached) mean of its upload's restarts."""
    x, restarts = inputs.images, inputs.restarts
    centre = x.detach().reshape(-1, restarts, *x.shape[1:]).mean(1).repeat_interleave(restarts, dim=0)
    return ((x - centre) ** 2).flatten(1).mean(1)


@register_prior("epoch-order")
def epoch_order_prior(inputs: TermInputs) -> torch.Tensor:
    """The epoch-order-invariant prior (Dimitrov et al., TMLR 2022) as a symmetric Chamfer distance: per copy
    after the first, the mean squared pixel distance of each image to its nearest image of copy 0 and of each
    image of copy 0 to its nearest in that copy, averaged over copies (J,); 0 when every copy holds the same
    images in any order."""
    copies = inputs.copies
    x = inputs.images.flatten(2)
    if copies < 2:
        return x.new_zeros(x.shape[0])
    x = x.reshape(x.shape[0], copies, -1, x.shape[-1])
    first = x[:, 0]
    total = x.new_zeros(x.shape[0])
    for e in range(1, copies):
        squared = torch.cdist(first, x[:, e]).square() / x.shape[-1]
        total = total + squared.min(-1).values.mean(-1) + squared.min(-2).values.mean(-1)
    return total / (copies - 1)


def latent_kl(z: torch.Tensor) -> torch.Tensor:
    """GGL's latent prior: KL(N(m, v) || N(0, 1)) with m, v the mean and variance of each latent's entries,
    averaged over the batch: (..., B, latent_dim) -> (...)."""
    var = z.var(-1, unbiased=False)
    return (0.5 * (var + z.mean(-1) ** 2 - 1 - torch.log(var + 1e-10))).mean(-1)


@register_prior("kl")
def kl_prior(inputs: TermInputs) -> torch.Tensor:
    """``latent_kl`` of the search variable (latents (J, B, latent_dim))."""
    return latent_kl(inputs.z)


@dataclass(frozen=True)
class Term:
    """A prior of the objective: ``weight * PRIORS[name]``, counted from ``start`` (a fraction of the iterations)
    on; ``selects``: whether it counts when the best restart is chosen."""

    name: str
    weight: float
    start: float = 0.0
    selects: bool = True

    def __post_init__(self) -> None:
        if self.name not in PRIORS:
            raise ValueError(f"prior {self.name!r}: choose one of {', '.join(PRIORS)}")
        if self.weight < 0:
            raise ValueError(f"{self.name} weight must be >= 0, got {self.weight}")
        if not 0 <= self.start <= 1:
            raise ValueError(f"{self.name} start must be a fraction of the iterations in [0, 1], got {self.start}")
