"""The attack interface, what attacks may ask of the threat model, and the attack registry.

An attack sees nothing but an ``Observation`` (what the server received) and
returns a ``Reconstruction``. Each attack declares what it needs beyond the
upload; a run whose threat model does not grant it fails at configuration
time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from fedguard.observation import Observation
from fedguard.registry import Registry

NEEDS = {
    "labels": "the true labels of the batch",
    "bn-statistics": "the BatchNorm statistics of the batch",
    "hyperparameters": "the client's declared local hyper-parameters",
}


@dataclass
class Reconstruction:
    """``images`` (B, C, H, W) in [0, 1], ``labels`` (B,) int64, and attack statistics (loss, iterations, ...)."""

    images: torch.Tensor
    labels: torch.Tensor
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class AttackOutcome:
    """What became of one observation: ``status`` is 'ok', 'error' or 'timeout'."""

    observation: Observation
    status: str
    reconstruction: Reconstruction | None = None
    error: str | None = None
    seconds: float = 0.0
    worker: int = -1


class Attack(Protocol):
    """Server-side attack on one captured upload."""

    needs: frozenset[str]
    uploads: frozenset[str]

    def reconstruct(self, obs: Observation) -> Reconstruction: ...

    def reconstruct_many(self, observations: list[Observation]) -> list[Reconstruction]: ...


AttackBuilder = Callable[[Any], Attack]

ATTACKS: Registry[AttackBuilder] = Registry("attack")
register_attack = ATTACKS.register


def build_attack(name: str, params: Any = None) -> Attack:
    """The registered attack ``name`` configured with ``params``."""
    return ATTACKS.build(name, params=params)


def shape_key(obs: Observation) -> tuple:
    """Observations with equal keys (model, data shape, batch size, upload kind) can be attacked as one batch."""
    batch = int(obs.declared.get("batch-size", obs.num_examples))
    return (obs.model, tuple(sorted(obs.model_params.items())), obs.spec, batch, obs.kind)


def missing_grants(attack: Attack, granted: set[str]) -> list[str]:
    """What ``attack`` needs that the threat model does not grant, described for an error message."""
    return [f"{need} ({NEEDS[need]})" for need in sorted(attack.needs - granted)]
