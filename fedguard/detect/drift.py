"""The change of the received model since the last ones the client accepted, against an honest round's step.

For each trainable weight ``W`` (two or more dimensions) of the received model and ``W'`` of a reference::

    change_W = ||W - W'|| / (||W|| + ||W'||)      in [0, 1]

The references are the last ``references`` received models that no detector flagged (kept in the client's
state, the newest first). ``drift`` is the largest change over the weights against the nearest reference, and
``layer`` the index (among the weights) where it is. An honest aggregation moves every weight by a few
learning-rate-sized steps, a small fraction of its norm; a server that rewrites a layer (imprint, trap weights,
fishing's last layer) replaces it by one unrelated to the last, which gives about ``1 / sqrt(2)`` or more. The
model is flagged when ``drift`` reaches ``threshold``, that is when it is that far from every reference, and
only once the client holds ``references`` of them: a client's first round has none (``drift`` 0), and until
then ``drift`` is reported against those it has but flags nothing.

Why more than one reference: nothing flags a manipulation sent in a client's first round (no reference), and a
model that got through becomes a reference. Against it alone every honest model after it looks far, gets
flagged, and since a flagged model never becomes a reference the client would flag every later round. With two,
an honest model is near the honest one of the two, so one manipulated reference raises no false alarm, and it
leaves the references after ``references`` accepted rounds. The price is a window: a server whose manipulation
got through once can send it again every other round (alternating with honest rounds) and stay near one
reference (see the threat-model docs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedguard.detect.base import STATE_PREFIX, Finding, Received, register_detector, weights

KEY = f"{STATE_PREFIX}drift."  # state key prefix of the references: detect.drift.<slot>.<index>, slot 0 newest


@dataclass(frozen=True)
class DriftParams:
    """``threshold``: flag at this relative change of one weight from every reference (in [0, 1]);
    ``references``: how many of the last accepted models to compare with (1: the last only; a client flags
    nothing before it has accepted that many)."""

    threshold: float = 0.55
    references: int = 2

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.references < 1:
            raise ValueError(f"references must be at least 1, got {self.references}")


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


def _slot(slot: int) -> str:
    return f"{KEY}{slot}."


def stored(state: dict[str, torch.Tensor]) -> list[list[torch.Tensor]]:
    """The references kept in ``state``, newest first, each its weights in order (empty before the first)."""
    references: list[list[torch.Tensor]] = []
    while any(key.startswith(_slot(len(references))) for key in state):
        prefix = _slot(len(references))
        count = sum(1 for key in state if key.startswith(prefix))
        references.append([state[f"{prefix}{i}"] for i in range(count)])
    return references


def store(state: dict[str, torch.Tensor], references: list[list[torch.Tensor]]) -> None:
    """Replace the references in ``state`` (in place) by ``references``, newest first."""
    for key in [key for key in state if key.startswith(KEY)]:
        del state[key]
    for slot, reference in enumerate(references):
        state.update({f"{_slot(slot)}{i}": w for i, w in enumerate(reference)})


class DriftDetector:
    """Flags a received model that changed from each of the last accepted ones more than an honest round does."""

    def __init__(self, params: DriftParams) -> None:
        self.params = params

    def __call__(self, received: Received, state: dict[str, torch.Tensor]) -> Finding:
        references = stored(state)[: self.params.references]
        if not references:
            return Finding({"drift": 0.0, "layer": -1.0, "reference": 0.0}, False)
        current = weights(received.model)
        nearest = min((relative_changes(current, r) for r in references), key=lambda changes: float(changes.max()))
        layer = int(nearest.argmax())
        score = float(nearest[layer])
        flagged = len(references) == self.params.references and score >= self.params.threshold
        return Finding({"drift": score, "layer": float(layer), "reference": float(len(references))}, flagged)

    def remember(self, received: Received, state: dict[str, torch.Tensor]) -> None:
        """Make the received weights the newest reference in ``state``, dropping the oldest beyond
        ``references``."""
        newest = [w.cpu().clone() for w in weights(received.model)]
        store(state, [newest, *stored(state)][: self.params.references])


@register_detector("drift", params=DriftParams)
def build_drift(params: DriftParams) -> DriftDetector:
    """Relative change of each weight since the last models the client accepted."""
    return DriftDetector(params)
