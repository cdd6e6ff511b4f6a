"""The change of the received model since the last one the client accepted, against an honest round's step.

For each trainable weight ``W`` (two or more dimensions) of the received model and ``W'`` of the reference
(the last received model no detector flagged, kept in the client's state)::

    change_W = ||W - W'|| / (||W|| + ||W'||)      in [0, 1]

``drift`` is the largest over the weights and ``layer`` the index (among the weights) where it is. An honest
aggregation moves every weight by a few learning-rate-sized steps, a small fraction of its norm; a server that
rewrites a layer (imprint, trap weights) replaces it by one unrelated to the last, which gives about
``1 / sqrt(2)`` or more. The first round a client takes part in has no reference: ``drift`` 0. The model is
flagged at ``threshold``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedguard.detect.base import STATE_PREFIX, Finding, Received, register_detector, weights

KEY = f"{STATE_PREFIX}drift."  # state key prefix of the reference weights: detect.drift.<index>


@dataclass(frozen=True)
class DriftParams:
    """``threshold``: flag at this relative change of one weight (in [0, 1])."""

    threshold: float = 0.55

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")


def relative_changes(current: list[torch.Tensor], reference: list[torch.Tensor]) -> torch.Tensor:
    """(L,) float64: ``change_W`` of each pair of weights (0 where both are zero); raises ``ValueError`` when
    the layouts differ."""
    if [c.shape for c in current] != [r.shape for r in reference]:
        raise ValueError(
            f"the stored reference weights {[tuple(r.shape) for r in reference]} differ from the received ones "
            f"{[tuple(c.shape) for c in current]}: the model changed between rounds"
        )
    changes = []
    for c, r in zip(current, reference):
        c64, r64 = c.to(torch.float64), r.to(torch.float64).to(c.device)
        total = float(c64.norm() + r64.norm())
        changes.append(float((c64 - r64).norm()) / total if total > 0 else 0.0)
    return torch.tensor(changes, dtype=torch.float64)


def stored(state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The reference weights kept in ``state``, in order (empty before the first)."""
    count = sum(1 for key in state if key.startswith(KEY))
    return [state[f"{KEY}{i}"] for i in range(count)]


class DriftDetector:
    """Flags a received model that changed more than an honest round changes it."""

    def __init__(self, params: DriftParams) -> None:
        self.params = params

    def __call__(self, received: Received, state: dict[str, torch.Tensor]) -> Finding:
        reference = stored(state)
        if not reference:
            return Finding({"drift": 0.0, "layer": -1.0, "reference": 0.0}, False)
        changes = relative_changes(weights(received.model), reference)
        layer = int(changes.argmax())
        score = float(changes[layer])
        return Finding({"drift": score, "layer": float(layer), "reference": 1.0}, score >= self.params.threshold)

    def remember(self, received: Received, state: dict[str, torch.Tensor]) -> None:
        """Keep the received weights in ``state`` as the next round's reference."""
        for i, w in enumerate(weights(received.model)):
            state[f"{KEY}{i}"] = w.cpu().clone()


@register_detector("drift", params=DriftParams)
def build_drift(params: DriftParams) -> DriftDetector:
    """Relative change of each weight since the last model the client accepted."""
    return DriftDetector(params)
