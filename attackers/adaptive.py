"""Adaptive Inverting Gradients: IG against a defense the server knows (threat.defense), with its parameters but
not its randomness nor the client's data.

The clients' defense declares what its upload reveals (``fedguard.defenses.revealed``) and the search matches that
instead of the plain cosine (``attackers.engine.aware``): only the sent entries and the magnitude band the others
were dropped from (pruning, DGP; the labels read with the removed bias entries restored, ``attackers.labels``), the
cosine (quantization; with ``rounding = "likelihood"`` the stochastic rounding's likelihood added late), the true
and the robust images' gradients mixed as Refiner's projection mixes them (searching both batches and the robust
share), CENSOR's per-tensor orthogonality and norms (or, for an upload whose Linear weights have the rank of a raw
gradient, Algorithm 1's raw fallback: plain IG), the clipped update under DP noise; Soteria's protected layer is
left out of the distance. Everything else (iterations, restarts, step, TV prior, schedule) is IG's, so that a sweep
compares the two on equal budgets. Report the stronger of IG and this attack (EVALUATION.md, point 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from attackers.base import AttackTraits, Reconstruction, register_attack
from attackers.engine import SearchSpec
from attackers.engine.search import search
from attackers.engine.spec import leaves_some
from attackers.gradient_rank import is_raw_update
from attackers.inverting_gradients import InvertingGradients, InvertingGradientsParams
from attackers.jobs import stateless_model
from fedguard.defenses.revealed import (
    AlteredLayer,
    OrthogonalPerTensor,
    Revealed,
    TowardsRobustData,
    Unchanged,
    Undeclared,
    revealed_by,
)
from fedguard.defenses.soteria import resolve_layer
from fedguard.observation import Observation

REFINER_READINGS = ("mixture", "radius")
ROUNDING_READINGS = ("cosine", "likelihood")
UNDECLARED_CHOICES = ("plain", "refuse")  # a defense without revealed(): attack it as undefended, or refuse it


@dataclass(frozen=True)
class AdaptiveInvertingGradientsParams(InvertingGradientsParams):
    """IG's parameters, how a Refiner upload is read: ``refiner`` 'mixture' (the true and the robust images'
    gradients mixed by the projection, both batches and the robust share searched) or 'radius' (every gradient
    within the radius accepted, the TV prior choosing among them), ``band``: the weight of the penalty on the
    unsent entries of a pruning or DGP upload beside the masked cosine (0: the masked cosine alone), and
    ``rounding``: how a quantized upload is matched, 'cosine' (as IG does) or 'likelihood' (the cosine, plus
    the stochastic rounding's likelihood for the last quarter of the iterations), and ``undeclared``: against a
    defense that declares nothing it reveals (no ``revealed()``), 'plain' (match the upload as IG does, every row
    marked not adaptive with the reason) or 'refuse' (fail the attack, naming the defense)."""

    refiner: str = "mixture"
    band: float = 1.0
    rounding: str = "cosine"
    undeclared: str = "plain"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.refiner not in REFINER_READINGS:
            raise ValueError(f"refiner {self.refiner!r}: choose one of {', '.join(REFINER_READINGS)}")
        if self.rounding not in ROUNDING_READINGS:
            raise ValueError(f"rounding {self.rounding!r}: choose one of {', '.join(ROUNDING_READINGS)}")
        if self.undeclared not in UNDECLARED_CHOICES:
            raise ValueError(f"undeclared {self.undeclared!r}: choose one of {', '.join(UNDECLARED_CHOICES)}")
        if not (math.isfinite(self.band) and self.band >= 0):
            raise ValueError(f"band must be a finite weight >= 0 (0: the masked cosine alone), got {self.band}")


def altered_weight(obs: Observation, revealed: AlteredLayer) -> str:
    """The name of the weight ``revealed`` says was altered, resolved on ``obs``'s model ('' is its last Linear)."""
    return f"{resolve_layer(stateless_model(obs, torch.device('cpu')), revealed.layer)}.weight"


def adapted_spec(spec: SearchSpec, revealed: Revealed, obs: Observation) -> SearchSpec:
    """``spec`` matching what the upload ``revealed``; for an altered layer, that layer's weight is skipped."""
    if isinstance(revealed, AlteredLayer):
        skip = ",".join(p for p in (spec.skip, altered_weight(obs, revealed)) if p)
        return replace(spec, skip=skip, matching=revealed)
    return replace(spec, matching=revealed)


class AdaptiveInvertingGradients(InvertingGradients):
    """Inverting Gradients with the known defense's distance (``attackers.engine.aware``)."""

    revealed: Revealed | None = None
    not_adaptive = ""  # why the search matches the plain cosine against this defense ('' where it adapts)
    sums: frozenset[str] = frozenset()  # what a defense reveals holds for one client's upload, not for an aggregate

    def __init__(self, params: AdaptiveInvertingGradientsParams) -> None:
        super().__init__(params)
        self.needs = adaptive_traits(params).needs
        self.refiner = params.refiner
        self.undeclared = params.undeclared
        self.spec = replace(self.spec, band_weight=params.band, rounding_likelihood=params.rounding == "likelihood")

    def know_defense(self, defense: Any) -> None:
        """The clients' defense: what its uploads reveal (a Refiner upload read as ``refiner`` says), and the
        defense itself for EOT draws."""
        self.defense = defense
        revealed = revealed_by(defense)
        name = type(defense).__name__
        if isinstance(revealed, Undeclared) and self.undeclared == "refuse":
            raise ValueError(
                f"defense {name} declares nothing it reveals (no revealed()): ig-adaptive cannot adapt to it "
                "(attack.ig-adaptive.undeclared = 'refuse'; 'plain' attacks it as undefended, marked not adaptive)"
            )
        self.not_adaptive = {
            Unchanged: f"defense {name} sends the update unchanged: matched as IG does",
            Undeclared: f"defense {name} declares nothing it reveals (no revealed()): matched as undefended",
        }.get(type(revealed), "")
        self.revealed = (
            revealed.ball() if isinstance(revealed, TowardsRobustData) and self.refiner == "radius" else revealed
        )

    def reconstruct_many(self, observations: list[Observation], seed: int) -> list[Reconstruction]:
        if self.revealed is None:
            raise ValueError("attack 'ig-adaptive' needs the clients' defense (set threat.defense = true)")
        by_index: dict[int, Reconstruction] = {}
        stepped = every_step_reason(self.defense)
        plain = [i for i, obs in enumerate(observations) if stepped and obs.kind == "weights"]
        rest = [i for i in range(len(observations)) if i not in plain]
        plan: list[tuple[Revealed, list[int], str]] = [(Undeclared(), plain, stepped)] if plain else []
        for revealed, indices in told_apart(self.revealed, [observations[i] for i in rest]).items():
            if indices:
                plan.append((revealed, [rest[i] for i in indices], self.not_adaptive))
        for revealed, indices, not_adaptive in plan:
            group = [observations[i] for i in indices]
            spec = adapted_spec(self.spec, revealed, group[0])
            for index, result in zip(indices, search(spec, group, seed, decoder=self.decoder, defense=self.defense)):
                result.stats["matched"] = type(revealed).__name__
                result.stats["adaptive"] = not not_adaptive
                if not_adaptive:
                    result.stats["not_adaptive"] = not_adaptive
                by_index[index] = result
        return [by_index[index] for index in range(len(observations))]


def every_step_reason(defense: Any) -> str:
    """Why the search does not adapt to a model upload under ``defense``, one that every local step followed
    (``DefenseTraits.defends_steps``: DP-SGD under FedAvg); '' for any other."""
    if not getattr(defense, "defends_steps", False):
        return ""
    return (
        f"defense {type(defense).__name__} was followed by every local step of this model upload; the search models "
        "one defended update: matched as undefended"
    )


def told_apart(revealed: Revealed, observations: list[Observation]) -> dict[Revealed, list[int]]:
    """The uploads' indices by what each reveals. Under CENSOR's raw fallback the rank of the Linear weights
    (``attackers.gradient_rank``) says which uploads are the raw gradient (matched as undefended) and which are
    orthogonal candidates; an upload it cannot tell keeps the declared either-or distance."""
    if not (isinstance(revealed, OrthogonalPerTensor) and revealed.raw_fallback):
        return {revealed: list(range(len(observations)))}
    cases: dict[bool | None, Revealed] = {
        True: Unchanged(),
        False: OrthogonalPerTensor(raw_fallback=False),
        None: revealed,
    }
    groups: dict[Revealed, list[int]] = {}
    for index, obs in enumerate(observations):
        groups.setdefault(cases[is_raw_update(obs)], []).append(index)
    return groups


def adaptive_traits(params: AdaptiveInvertingGradientsParams) -> AttackTraits:
    """IG's uploads; it always needs the defense, simulates it only with ``eot`` > 0, and is adaptive."""
    return AttackTraits.of(
        AdaptiveInvertingGradients,
        needs=frozenset({"defense"}),
        simulates_defense=params.eot > 0,
        adaptive=True,
        check_model=leaves_some(params.skip) if params.skip else None,
    )


@register_attack("ig-adaptive", params=AdaptiveInvertingGradientsParams, traits=adaptive_traits)
def build_adaptive_inverting_gradients(params: AdaptiveInvertingGradientsParams) -> AdaptiveInvertingGradients:
    """Inverting Gradients matching what the clients' known defense reveals (threat.defense)."""
    return AdaptiveInvertingGradients(params)
