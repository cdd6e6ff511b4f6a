"""Hostile clients as a plugin (``server.plugins=tests.hostile_defense``), used by ``tests/test_hostile_clients.py``:
``defense.name=overflow`` uploads 3e38 in every gradient entry, finite but near float32's largest value, so that the
mean of two such uploads overflows to infinity; ``defense.name=broken-client-1`` raises in client 1 only;
``defense.name=slow-client-1`` holds client 1's round 1 ``SLOW_SECONDS``, past a short ``server.round-timeout``;
``defense.name=dying-client-1`` ends client 1's process (``os._exit``) in round 2, as the OOM killer would."""

from __future__ import annotations

import os
import time

import torch

from fedguard.defenses import Defense, LocalStep, register_defense

NEAR_FLOAT32_MAX = 3e38
SLOW_SECONDS = 45.0


@register_defense("overflow")
def build_overflow(params: object) -> Defense:
    """Upload ``NEAR_FLOAT32_MAX`` in place of every gradient entry."""

    def defend(step: LocalStep, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [torch.full_like(g, NEAR_FLOAT32_MAX) for g in step.grads]

    return defend


@register_defense("broken-client-1")
def build_broken_client_1(params: object) -> Defense:
    """Upload the gradient as it is, but raise in client 1."""

    def defend(step: LocalStep, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        if step.client == 1:
            raise ValueError(f"client 1's defense broke in round {step.round}")
        return list(step.grads)

    return defend


@register_defense("slow-client-1")
def build_slow_client_1(params: object) -> Defense:
    """Upload the gradient as it is, ``SLOW_SECONDS`` late in client 1's round 1."""

    def defend(step: LocalStep, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        if step.client == 1 and step.round == 1:
            time.sleep(SLOW_SECONDS)
        return list(step.grads)

    return defend


@register_defense("dying-client-1")
def build_dying_client_1(params: object) -> Defense:
    """Upload the gradient as it is, but end client 1's process in round 2, once."""

    def defend(step: LocalStep, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        if step.client == 1 and step.round == 2:
            os._exit(3)
        return list(step.grads)

    return defend
