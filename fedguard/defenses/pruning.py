"""Magnitude pruning (Top-k sparsification) with optional error feedback: the DGP paper's "Top-k" baseline.

Per layer (trainable parameter tensor) of n entries, send the ceil(keep * n) entries of largest |value| and
zero the rest (Aji & Heafield 2017; Lin et al. 2017, DGC; Alistarh et al. 2018). ``keep`` = 0.2 is the DGP
paper's baseline (80 % pruned, the same upload size as DGP at k1 + k2 = 80 %); CENSOR's "Sparsi" (prune the
smallest 20 %) is ``keep`` = 0.8.

With ``error-feedback`` (as the DGP paper applies to Top-k, its App. C.1), client i carries what it did not send:

    P_t = grad_t + e_t          g_t = TopK(P_t)          e_{t+1} = P_t - g_t

in ``state`` (one residual per layer). The sent tensor and the residual are complementary copies of P's
entries, so g_t + e_{t+1} == P_t exactly. Without it ``state`` is neither read nor written.

Decisions: the count is rounded up (at least one entry of every layer is sent; the product is rounded to 9
decimals first); ties in |value| go to the earlier flat position. ``simulate`` prunes each job
without a residual and is differentiable through the sent entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedguard.defenses.base import class_traits, register_defense
from fedguard.defenses.magnitude import RankBandPruning, count
from fedguard.defenses.revealed import SentBand

PREFIX = "prune"


@dataclass(frozen=True)
class PruneParams:
    """``keep``: fraction of each layer's entries sent, the largest by |value|; ``error_feedback``: carry the
    pruned remainder to the next round."""

    keep: float = 0.2
    error_feedback: bool = True

    def __post_init__(self) -> None:
        if not (math.isfinite(self.keep) and 0 < self.keep <= 1):
            raise ValueError(f"keep must be in (0, 1], got {self.keep}")


class MagnitudePruning(RankBandPruning):
    """Send the top ``keep`` fraction of every layer by magnitude; optionally carry the rest over."""

    update_only = True  # reads only the update: a Flower mod applies it (fedguard.flower)

    prefix = PREFIX

    def __init__(self, params: PruneParams) -> None:
        self.params = params
        self.error_feedback = params.error_feedback

    def revealed(self) -> SentBand:
        """The sent entries, exact; every unsent one is at most the smallest sent magnitude."""
        return SentBand(drops_top=False)

    def bounds(self, size: int) -> tuple[int, int]:
        """Ranks 0 .. ceil(keep * size) - 1: the largest entries."""
        return 0, min(count(self.params.keep, size, round_up=True), size)


@register_defense("prune", params=PruneParams, traits=class_traits(MagnitudePruning))
def build_prune(params: PruneParams) -> MagnitudePruning:
    """Magnitude (Top-k) pruning per layer, with optional error feedback."""
    return MagnitudePruning(params)
