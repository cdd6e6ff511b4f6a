"""The attack interface, what attacks may ask of the threat model, and the attack registry.

An attack sees nothing but an ``Observation`` (what the server received) and
returns a ``Reconstruction``. Each attack declares what it needs beyond the
upload; a run whose threat model does not grant it fails at configuration
time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np
import torch

from fedguard.observation import Observation
from fedguard.registry import Registry

NEEDS = {
    "labels": "the true labels of the batch",
    "bn-statistics": "the BatchNorm statistics of the batch",
    "hyperparameters": "the client's declared local hyper-parameters",
    "defense": "the clients' defense and its parameters (not its randomness)",
}


@dataclass
class Reconstruction:
    """``images`` (B, C, H, W) in [0, 1], ``labels`` (B,) int64, and attack statistics (loss, iterations, ...);
    ``gradient``: the gradient the attack inverted when it changed the upload's (one array per trainable
    parameter; a denoising stage), scored by the evaluator against the clean one."""

    images: torch.Tensor
    labels: torch.Tensor
    stats: dict[str, Any] = field(default_factory=dict)
    gradient: list[np.ndarray] | None = None


@dataclass
class AttackOutcome:
    """What became of one attack on one observation: ``status`` is 'ok', 'error' or 'timeout'."""

    observation: Observation
    status: str
    reconstruction: Reconstruction | None = None
    error: str | None = None
    seconds: float = 0.0
    worker: int = -1
    attack: str = ""


class Attack(Protocol):
    """Server-side attack on one captured upload.

    ``needs``: what it needs beyond the upload (keys of ``NEEDS``); ``uploads``: the upload kinds it
    attacks; ``manipulation``: the malicious-server manipulation it exploits ('none' for honest-server
    attacks); it only attacks uploads computed on a model so manipulated."""

    needs: frozenset[str]
    uploads: frozenset[str]
    manipulation: str

    def reconstruct(self, obs: Observation) -> Reconstruction: ...

    def reconstruct_many(self, observations: list[Observation]) -> list[Reconstruction]: ...


AttackBuilder = Callable[[Any], Attack]

ATTACKS: Registry[AttackBuilder] = Registry("attack")
register_attack = ATTACKS.register


def build_attack(name: str, params: Any = None, defense: tuple[str, Any] | None = None) -> Attack:
    """The registered attack ``name`` configured with ``params``.

    ``defense`` (name, parameters) is the clients' defense, given to an attack that needs it (``needs`` holds
    'defense', e.g. IG with EOT) through its ``know_defense`` method."""
    attack = ATTACKS.build(name, params=params)
    if "defense" in attack.needs:
        if defense is None:
            raise ValueError(f"attack {name!r} needs the clients' defense, and none was given")
        from fedguard.defenses import build_defense

        attack.know_defense(build_defense(*defense))
    return attack


def images_per_upload(obs: Observation) -> int:
    """How many images an upload came from: the declared batch (a gradient) or every example (weights)."""
    if obs.kind == "weights":
        return int(obs.num_examples)
    return int(obs.declared.get("batch-size", obs.num_examples))


DEVICES = ("auto", "cpu", "cuda")


def check_search_params(iterations: int, restarts: int, lr: float, device: str) -> None:
    """The checks every optimization attack's parameters share; raises ``ValueError`` naming the bad value."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    if restarts < 1:
        raise ValueError(f"restarts must be >= 1, got {restarts}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if device not in DEVICES:
        raise ValueError(f"device {device!r}: choose one of {', '.join(DEVICES)}")


def shape_key(obs: Observation) -> tuple:
    """Observations with equal keys (model, data shape, image count, upload kind, local schedule) can be
    attacked as one batch."""
    schedule = tuple(sorted(obs.declared.items())) if obs.kind == "weights" else ()
    return (obs.model, tuple(sorted(obs.model_params.items())), obs.spec, images_per_upload(obs), obs.kind, schedule)


def required_manipulation(attack: Attack) -> str:
    """The manipulation ``attack`` exploits: 'none' for an honest-server attack."""
    return getattr(attack, "manipulation", "none")


def missing_grants(attack: Attack, granted: set[str], upload_kind: str = "gradient") -> list[str]:
    """What ``attack`` needs on uploads of ``upload_kind`` that the threat model does not grant, for an error message.

    ``attack.needs`` holds what it always needs; an optional ``needs_by_upload`` maps an upload kind to more."""
    needs = attack.needs | getattr(attack, "needs_by_upload", {}).get(upload_kind, frozenset())
    return [f"{need} ({NEEDS[need]})" for need in sorted(needs - granted)]
