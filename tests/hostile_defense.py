"""A hostile client as a plugin (``server.plugins=tests.hostile_defense``, ``defense.name=overflow``): every
gradient entry it uploads is 3e38, finite but near float32's largest value, so that the mean of two such
uploads overflows to infinity. Used by ``tests/test_hostile_clients.py``."""

from __future__ import annotations

import torch

from fedguard.defenses import Defense, LocalStep, register_defense

NEAR_FLOAT32_MAX = 3e38


@register_defense("overflow")
def build_overflow(params: object) -> Defense:
    """Upload ``NEAR_FLOAT32_MAX`` in place of every gradient entry."""

    def defend(step: LocalStep, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [torch.full_like(g, NEAR_FLOAT32_MAX) for g in step.grads]

    return defend
