"""Dual Gradient Pruning (DGP) with error feedback: Xue et al., "Revisiting Gradient Pruning: A Dual Realization
for Defending against Gradient Attacks", AAAI 2024 (arXiv 2401.16687).

Algorithm 1 (DGP), per layer l: rank the entries of the update by |value|; remove the top-k1 fraction
T_k1(W^l) (the largest, which carry the label and most of the image: the true-label row of the last layer
dominates since |dl/dr_y| = sum_{j != y} |dl/dr_j|) and the bottom-k2 fraction B_k2(W^l) (the smallest, for a
high pruning rate against active attacks and for communication); send the middle band, a fraction
1 - k1 - k2 of the entries. The pruning rate is k1 + k2 and p = k1 / k2 trades privacy for accuracy;
the paper's default is k1 = 5 %, k2 = 75 % (p = 1/15, 80 % pruned, 20 % sent).

Algorithm 2 (error feedback), client i at round t, with e_0 = 0:

    P_t = grad_t + e_t          g_t = DGP(k1, k2, P_t)          e_{t+1} = P_t - g_t

so everything removed, the largest entries included, is carried to the next round. The server averages the
sparse g_t of its clients (not done here).

Decisions where the paper is silent (following the notes' suggestions, censor-dgp.md B7):

* Layer: each trainable parameter tensor, weights and biases separately (B7.2).
* Counts for a layer of n entries (B7.1): n_top = ceil(k1 n) and n_bot = floor(k2 n) (``rounding`` =
  "protective"), then capped so that at least one entry is sent: n_top <= n - 1, n_bot <= n - 1 - n_top.
  Rounding the top count up matters for small tensors: for the 10-entry last-layer bias at k1 = 5 %, floor
  gives n_top = 0 and the largest entry, the true label's, is sent; ceil removes it (1 top, 7 bottom, 2 sent).
  ``rounding`` = "floor" floors both counts (the literal reading, kept for comparison). A 1-entry tensor is
  sent whole. The products are rounded to 9 decimals before ceil / floor (0.07 * 100 = 7.000000000000001).
* Ties in |value| are broken by flat position (the earlier entry ranks higher): the mask is a deterministic
  function of P. The band is found by selection (two ``kthvalue`` per layer), not a full sort.
* Exact conservation: the sent tensor and the residual are complementary copies of P's entries
  (``torch.where`` on one mask), so sent + e_{t+1} == P_t holds bit for bit in float32 (up to the sign of zero).
* ``ef-scope`` (B7.3): "all" is the paper's error feedback. Under it the removed largest entries grow in the
  residual and tend to be removed again, and once they fill the top band the fresh update's largest entries can
  be sent. "bottom" carries only the bottom-k2 entries and drops the removed top entries for good
  (sent + e_{t+1} + dropped == P_t). ``error-feedback`` = false (the paper's ablation, Fig. 4) neither reads
  nor writes ``state``.
* FedAvg: the same rule applies to the pseudo-gradient global - local (B7.11).
* ``simulate`` (an attacker re-applying the defense, for EOT) prunes each job without a residual; that is the
  client's own output at round 0 or without error feedback. The mask is constant, so gradients flow through
  the sent entries only.

The upload keeps the dense shapes with zeros at the removed entries; ``fedguard.wire.sparse`` encodes it as
(bit mask, values, shape) for transport.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedguard.defenses.base import class_traits, register_defense
from fedguard.defenses.magnitude import RankBandPruning, count
from fedguard.defenses.revealed import SentBand

EF_SCOPES = ("all", "bottom")
ROUNDINGS = ("protective", "floor")
PREFIX = "dgp"


@dataclass(frozen=True)
class DGPParams:
    """``k1``: fraction of largest-|g| entries removed per layer; ``k2``: fraction of smallest removed;
    ``error_feedback``: carry what was not sent to the next round; ``ef_scope``: all | bottom (which removed
    entries the residual keeps); ``rounding``: protective (ceil k1 n, floor k2 n) | floor (both floored)."""

    k1: float = 0.05
    k2: float = 0.75
    error_feedback: bool = True
    ef_scope: str = "all"
    rounding: str = "protective"

    def __post_init__(self) -> None:
        for name, value in (("k1", self.k1), ("k2", self.k2)):
            if not (math.isfinite(value) and 0 <= value < 1):
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if not self.k1 + self.k2 < 1:
            raise ValueError(f"k1 + k2 must be < 1 so that some entries are sent, got {self.k1} + {self.k2}")
        if self.ef_scope not in EF_SCOPES:
            raise ValueError(f"ef-scope {self.ef_scope!r}: choose one of {', '.join(EF_SCOPES)}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding {self.rounding!r}: choose one of {', '.join(ROUNDINGS)}")


class DualGradientPruning(RankBandPruning):
    """Send the middle magnitude band of every layer of update + residual; keep the rest as the residual."""

    update_only = True  # reads only the update: a Flower mod applies it (fedguard.flower)

    prefix = PREFIX

    def __init__(self, params: DGPParams) -> None:
        self.params = params
        self.error_feedback = params.error_feedback

    def counts(self, size: int) -> tuple[int, int]:
        """(n_top, n_bot): entries removed from the top and the bottom of a layer of ``size`` entries."""
        protective = self.params.rounding == "protective"
        top = min(count(self.params.k1, size, round_up=protective), max(size - 1, 0))
        bottom = min(count(self.params.k2, size, round_up=False), max(size - 1 - top, 0))
        return top, bottom

    def revealed(self) -> SentBand:
        """The sent entries, exact; every unsent one lies outside the sent band, above it too when ``k1`` > 0."""
        return SentBand(drops_top=self.params.k1 > 0)

    def bounds(self, size: int) -> tuple[int, int]:
        """Ranks n_top .. size - n_bot - 1: the middle band."""
        top, bottom = self.counts(size)
        return top, size - bottom

    def residual(self, flat: torch.Tensor, sent: torch.Tensor, bottom: torch.Tensor) -> torch.Tensor:
        """Everything unsent (``ef_scope`` all), or only the bottom-k2 entries (bottom)."""
        if self.params.ef_scope == "all":
            return super().residual(flat, sent, bottom)
        return torch.where(bottom, flat, 0.0)


@register_defense("dgp", params=DGPParams, traits=class_traits(DualGradientPruning))
def build_dgp(params: DGPParams) -> DualGradientPruning:
    """Dual Gradient Pruning (Xue et al. 2024): remove the top-k1 and bottom-k2 of each layer, error feedback."""
    return DualGradientPruning(params)
