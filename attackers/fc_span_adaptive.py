"""``fc-span`` against a defense the server knows (threat.defense): the first layer's update is first rebuilt from
what the defense sent (``attackers.span_completion``), then read as ``fc-span`` reads an undefended one.

- **Pruning and DGP** send exact entries of the rank-N update and bound the others. The update is factored as
  ``D X^T`` on the sent entries alone (alternating least squares, started from the bounded completion), and read
  on the pixels that hold enough sent entries to be determined, the others dark: the span is then exact there.
- **Quantization** bounds every entry within a level step: the update is completed within those bounds.

- **DP** adds known zero-mean noise to the clipped update: the rank-N truncation that ``fc-span`` takes is the
  maximum-likelihood estimate of a rank-N matrix under i.i.d. Gaussian noise, so the upload is read as ``fc-span``
  reads it, and the row records ``noise_margin``: the largest singular value the first layer's update can have
  (``clip``: the whole update is clipped to it) over the spiked-model detection threshold ``std (m n)^(1/4)`` of an
  (m, n) matrix of that noise (Benaych-Georges and Nadakuditi, 2012). Below 1, no spectral estimate of the span
  correlates with the true one as m and n grow.
- **Soteria** alters one Linear layer's weight gradient: where that layer is not the first, the first layer's update
  is sent exactly and read as it is.

Any other record (Soteria on the first layer, an unchanged or undeclared upload) is read as ``fc-span`` reads it,
and the row says why it is not adaptive there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from attackers.adaptive import altered_weight
from attackers.base import AttackTraits, Reconstruction, images_per_upload, register_attack
from attackers.fc_span import SpanAttack, SpanParams, first_layer_matrix
from attackers.span_completion import Bounds, complete, consistent_set, factor_sent
from attackers.trap_weights import first_layer_update
from fedguard.defenses.revealed import AlteredLayer, ClippedNoise, Revealed, SentBand, revealed_by
from fedguard.observation import Observation


@dataclass(frozen=True)
class AdaptiveSpanParams(SpanParams):
    """``fc-span``'s parameters; ``iterations``: the alternating projections of the bounded completion (each one
    rank-N projection of the first layer's update); ``sweeps``: the alternating least-squares sweeps that factor a
    pruned or DGP update on its sent entries; ``spare``: the sent entries beyond the rank that a pixel (and a
    unit) must hold to be read."""

    iterations: int = 100
    sweeps: int = 20
    spare: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.iterations <= 100_000:
            raise ValueError(f"iterations must be in 1..100000, got {self.iterations}")
        if not 0 <= self.sweeps <= 10_000:
            raise ValueError(f"sweeps must be in 0..10000, got {self.sweeps}")
        if not 0 <= self.spare <= 1_000:
            raise ValueError(f"spare must be in 0..1000, got {self.spare}")


class AdaptiveSpanAttack(SpanAttack):
    """``fc-span`` on the first layer's update rebuilt from what the known defense sent (module docstring)."""

    needs: frozenset[str] = frozenset({"defense"})
    sums: frozenset[str] = frozenset()  # the defense's record bounds one client's upload, not an aggregate
    revealed: Revealed | None = None

    def __init__(self, params: AdaptiveSpanParams) -> None:
        super().__init__(params)
        self.adaptive = params

    def know_defense(self, defense: Any) -> None:
        """The clients' defense: what its uploads reveal."""
        self.defense_name = type(defense).__name__
        self.revealed = revealed_by(defense)

    def reconstruct_one(self, obs: Observation, rng: np.random.Generator) -> Reconstruction:
        """The images of one upload, its first layer rebuilt where the defense's record bounds it."""
        start = time.perf_counter()
        rebuilt, stats = self.rebuild(obs)
        result = self.read_span(obs, first_layer_matrix(obs) if rebuilt is None else rebuilt, rng, start)
        result.stats.update(stats)
        return result

    def rebuild(self, obs: Observation) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """(the first layer's update ``[dW | db]`` (units, d + 1) rebuilt from what the defense sent, None where its
        record bounds no entry; the stats that say how)."""
        if self.revealed is None:
            raise ValueError("attack 'fc-span-adaptive' needs the clients' defense (set threat.defense = true)")
        index, weight, bias = first_layer_update(obs)
        if isinstance(self.revealed, ClippedNoise):
            return None, {"adaptive": True, "noise_margin": noise_margin(self.revealed, weight.shape)}
        if isinstance(self.revealed, AlteredLayer):
            altered = altered_weight(obs, self.revealed)
            if altered != obs.names[index]:
                return None, {"adaptive": True, "exact": f"the altered layer {altered} is not the first: sent as is"}
        bounds = consistent_set(self.revealed, weight, bias)
        if bounds is None:
            return None, {"adaptive": False, "not_adaptive": self.plain_reason()}
        rank = images_per_upload(obs)
        completed = complete(bounds, rank, self.adaptive.iterations)
        stats: dict[str, Any] = {"adaptive": True, "completion_misfit": misfit(bounds, completed)}
        if not isinstance(self.revealed, SentBand):
            return completed, stats
        factored, stats["pixels_read"] = factor_sent(bounds, rank, completed, self.adaptive.sweeps, self.adaptive.spare)
        return factored, stats

    def plain_reason(self) -> str:
        """Why an upload of this defense is read as ``fc-span`` reads it."""
        return (
            f"defense {self.defense_name} ({type(self.revealed).__name__}) bounds no entry of the first layer's "
            "update: read as fc-span reads it"
        )


def noise_margin(revealed: ClippedNoise, weight_shape: torch.Size) -> float | None:
    """The first layer's largest possible singular value over the spiked-model detection threshold of the noise on
    its ``[dW | db]`` (weight (units, d) plus the bias column: module docstring); None for DP-SGD, whose noise on a
    FedAvg update depends on the local steps."""
    if revealed.per_example:
        return None
    if revealed.noise_std <= 0:
        return float("inf")
    units, inputs = weight_shape
    return revealed.clip / (revealed.noise_std * (units * (inputs + 1)) ** 0.25)


def misfit(bounds: Bounds, completed: torch.Tensor) -> float:
    """How far the completed matrix lies from the consistent set, relative to the sent matrix's norm."""
    gap = (bounds.project(completed) - completed).norm()
    return float(gap / bounds.sent.norm().clamp_min(1e-30))


@register_attack(
    "fc-span-adaptive",
    params=AdaptiveSpanParams,
    traits=lambda params: AttackTraits.of(AdaptiveSpanAttack, adaptive=True),
)
def build_adaptive_span_attack(params: AdaptiveSpanParams) -> AdaptiveSpanAttack:
    """``fc-span`` on the first layer's update rebuilt from what the known defense sent."""
    return AdaptiveSpanAttack(params)
