"""No defense: the raw update is uploaded."""

from __future__ import annotations

import torch

from fedguard.defenses.base import LocalStep, class_traits, register_defense
from fedguard.defenses.revealed import Unchanged


class NoDefense:
    """Uploads ``step.grads`` unchanged."""

    update_only = True  # reads only the update: a Flower mod applies it (fedguard.flower)

    def __call__(self, step: LocalStep, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return list(step.grads)

    def revealed(self) -> Unchanged:
        """The upload is the gradient."""
        return Unchanged()

    def simulate(self, grads: list[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
        """The identity on (J, ...) updates."""
        return list(grads)


@register_defense("none", traits=class_traits(NoDefense))
def build_none(params: object) -> NoDefense:
    """Upload the raw update (the undefended baseline)."""
    return NoDefense()
