"""Gradient quantization baseline: per-tensor uniform levels with unbiased stochastic rounding.

Scheme, for each trainable parameter tensor g of n entries and ``bits`` = b:

    lo = min g,  hi = max g,  L = 2**b levels,  step = (hi - lo) / (L - 1)
    u = (g - lo) / step in [0, L - 1],  k = floor(u) + Bernoulli(u - floor(u)),  q = lo + k * step

so every entry moves to one of its two neighbouring levels, the upper one with probability equal to its
distance from the lower one in steps: E[q] = lo + step * u = g (unbiased; variance at most step**2 / 4 per
entry), and q takes at most L distinct values. The Bernoulli draws are one uniform per entry from the step's
generator, tensor by tensor in parameter order. The top level is hi itself (lo + (L - 1) * step can miss it by
a rounding error), so q stays within [lo, hi]. A constant tensor (hi == lo, step 0) is sent unchanged (it is
its own single level). On the wire a tensor needs ceil(b * n / 8) bytes of level indices plus lo and step
(two float32); the defense returns the dequantized values q in the update's dtype, which is what the server
aggregates. ``bits`` in 1..16; 1 bit sends each entry as lo or hi.

``simulate`` (for EOT) quantizes each job of (J, ...) updates with its own lo and hi and fresh draws; its
gradient is the straight-through estimator (identity), since rounding has zero derivative almost everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedguard.defenses.base import LocalStep, class_traits, register_defense
from fedguard.defenses.revealed import QuantizedLevels

MAX_BITS = 16


@dataclass(frozen=True)
class QuantizeParams:
    """``bits``: bits per entry, 2**bits uniform levels between each tensor's minimum and maximum."""

    bits: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or int(self.bits) != self.bits or not 1 <= self.bits <= MAX_BITS:
            raise ValueError(f"bits must be an integer in [1, {MAX_BITS}], got {self.bits}")


def level_grid(flat: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lo, hi, step), each (J, 1): the minimum and maximum of each row of ``flat`` (J, n) and the step between
    its 2**bits uniform levels."""
    lo = flat.min(dim=1, keepdim=True).values
    hi = flat.max(dim=1, keepdim=True).values
    return lo, hi, (hi - lo) / (2**bits - 1)


def stochastic_levels(flat: torch.Tensor, bits: int, generator: torch.Generator) -> torch.Tensor:
    """Rows of ``flat`` (J, n) rounded at random to 2**bits uniform levels spanning each row's [min, max]."""
    lo, hi, step = level_grid(flat, bits)
    top = 2**bits - 1
    constant = step == 0
    scaled = (flat - lo) / torch.where(constant, 1.0, step)
    lower = scaled.floor()
    draws = torch.rand(flat.shape, generator=generator, dtype=flat.dtype, device=generator.device)
    level = (lower + (draws.to(flat.device) < scaled - lower).to(flat.dtype)).clamp(0, top)
    return torch.where(constant, flat, torch.where(level == top, hi, lo + level * step))


class StochasticQuantization:
    """Quantize every tensor of the update to ``bits`` bits, unbiased."""

    update_only = True  # reads only the update: a Flower mod applies it (fedguard.flower)

    def __init__(self, params: QuantizeParams) -> None:
        self.params = params

    def __call__(self, step: LocalStep, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [
            stochastic_levels(g.detach().reshape(1, -1), self.params.bits, step.generator).reshape(g.shape)
            for g in step.grads
        ]

    def revealed(self) -> QuantizedLevels:
        """Every entry within one level step of the true one."""
        return QuantizedLevels(self.params.bits)

    def simulate(self, grads: list[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
        """Each job of (J, ...) updates quantized with fresh draws; straight-through gradient."""
        out = []
        for g in grads:
            flat = g.flatten(1)
            quantized = stochastic_levels(flat.detach(), self.params.bits, generator)
            out.append((quantized + (flat - flat.detach())).reshape(g.shape))  # value q exactly, gradient 1
        return out


@register_defense("quantize", params=QuantizeParams, traits=class_traits(StochasticQuantization))
def build_quantize(params: QuantizeParams) -> StochasticQuantization:
    """Per-tensor uniform quantization to ``bits`` bits with unbiased stochastic rounding."""
    return StochasticQuantization(params)
