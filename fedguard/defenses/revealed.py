"""What a defended upload tells a server that knows the defense and its parameters (threat.defense), not its
randomness nor the client's data: the declared interface between a defense's mathematics and the attacks that
adapt to it (``attackers.engine.aware``).

Each shipped defense answers ``revealed()`` with one of these records; a plugin defense that does not reveals
``Undeclared``: it is attacked as if its upload were the gradient itself, and the adaptive attack says so (its
rows are marked not adaptive, with the reason), or refuses it (``attack.ig-adaptive.undeclared = "refuse"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Unchanged:
    """The upload is the client's gradient (or update) itself."""


@dataclass(frozen=True)
class Undeclared:
    """The defense declares nothing (it has no ``revealed()``): a server that knows it can only match its upload
    as the gradient itself."""


@dataclass(frozen=True)
class SentBand:
    """Per tensor, the entries whose magnitude ranks in a band were sent exactly, the others as zeros:
    ``drops_top`` (DGP) when entries above the band were removed too (their magnitude is then at least the
    largest sent one's), otherwise (top-k pruning) every unsent entry is at most the smallest sent one's. Exact
    for an upload without an error-feedback residual (round 1, or ``error-feedback = false``)."""

    drops_top: bool


@dataclass(frozen=True)
class QuantizedLevels:
    """Per tensor, ``2**bits`` uniform levels between its minimum and maximum (both sent exactly); every entry
    was rounded to one of its two neighbouring levels, the one ``d`` steps away with probability ``1 - d``, so the
    true entry lies within one level step of it."""

    bits: int


@dataclass(frozen=True)
class TowardsRobustData:
    """The upload is the true gradient g moved at most ``r`` towards the gradient g* of a robust batch x* with
    the same labels: ``u = (1 - c) g + c g*`` with ``c = min(1, r / ||g* - g||)`` (every tensor together), so
    that ``||u - g|| <= r``; ``r = epsilon * ||g||`` (``relative``) or ``epsilon`` (absolute). The upload is
    then the gradient of the 2B images x and x* with the loss weights (1 - c) / B and c / B."""

    epsilon: float
    relative: bool

    def ball(self) -> WithinRadius:
        """The weaker reading: only that the upload lies within ``r`` of the true gradient."""
        return WithinRadius(self.epsilon, self.relative)


@dataclass(frozen=True)
class WithinRadius:
    """The upload lies in the L2 ball of radius ``r`` around the true gradient g, every tensor together:
    ``r = epsilon * ||g||`` (``relative``) or ``epsilon`` (absolute)."""

    epsilon: float
    relative: bool


@dataclass(frozen=True)
class OrthogonalPerTensor:
    """Per tensor, the upload is orthogonal to the true gradient's and of the same norm, unless the client fell
    back to the raw gradient (``raw_fallback``: Algorithm 1's G* = G^0, which the upload does not mark)."""

    raw_fallback: bool


@dataclass(frozen=True)
class AlteredLayer:
    """The weight gradient of one Linear module (``layer``; '' = the model's last Linear) was altered, every
    other tensor is exact."""

    layer: str


@dataclass(frozen=True)
class ClippedNoise:
    """The update was clipped to L2 norm ``clip`` (every tensor together; per example for DP-SGD, the same for a
    batch of one) and zero-mean noise added to every entry: the upload's expectation is the clipped update.
    ``noise_std``: that noise's per-entry standard deviation in gradient units, on the update, or (``per_example``,
    DP-SGD) on the sum of the clipped per-example gradients, which the upload then divides by the batch."""

    clip: float
    noise_std: float = 0.0
    per_example: bool = False

    def std(self, batch_size: int) -> float:
        """The per-entry noise standard deviation of an upload of a batch of ``batch_size``, in gradient units."""
        return self.noise_std / batch_size if self.per_example else self.noise_std


Revealed = (
    Unchanged
    | Undeclared
    | SentBand
    | QuantizedLevels
    | TowardsRobustData
    | WithinRadius
    | OrthogonalPerTensor
    | AlteredLayer
    | ClippedNoise
)


@runtime_checkable
class RevealingDefense(Protocol):
    """A defense that declares what its uploads reveal to a server that knows it."""

    def revealed(self) -> Revealed: ...


def revealed_by(defense: object) -> Revealed:
    """What ``defense``'s uploads reveal; ``Undeclared`` for one that declares nothing."""
    return defense.revealed() if isinstance(defense, RevealingDefense) else Undeclared()
