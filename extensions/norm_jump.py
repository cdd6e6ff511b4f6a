"""A detector of one's own, outside the fedguard package: a received model whose weights' norm jumped since the
last model the client accepted.

An honest round moves the weights by a few learning-rate-sized steps, so the L2 norm of all weights together
changes by a small fraction from one round to the next. The detector flags a received model whose norm differs
from the last accepted one's by more than a factor ``ratio`` either way (``extensions/scaled_layer.py`` multiplies
a weight by 10, which does). The norm of the last model no detector flagged is kept in the client's state, under
``detect.norm-jump.norm``; a client's first round has none and flags nothing.

Select it from the configuration (the module must be importable: this repository's root is)::

    fedguard run experiments/quickstart.toml --set server.plugins=extensions.norm_jump \\
        --set detect.name=norm-jump --set detect.norm-jump.ratio=1.5
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fedguard.detect import Finding, Received, register_detector
from fedguard.detect.base import STATE_PREFIX, weights

KEY = f"{STATE_PREFIX}norm-jump.norm"


@dataclass(frozen=True)
class NormJumpParams:
    """Flag a model whose weights' norm changed by more than a factor"""

    ratio: float = field(default=1.5, metadata={"help": "the largest honest change of the norm, as a factor (> 1)"})

    def __post_init__(self) -> None:
        if not 1 < self.ratio < 1e6:
            raise ValueError(f"ratio = {self.ratio!r}: must be > 1 and < 1e6")


def weight_norm(received: Received) -> float:
    """The L2 norm of all the received model's weights together."""
    return math.sqrt(sum(float(w.double().pow(2).sum()) for w in weights(received.model)))


class NormJump:
    """Flags a received model whose weights' norm is more than ``ratio`` times, or less than ``1 / ratio``
    times, the last accepted model's."""

    def __init__(self, params: NormJumpParams) -> None:
        self.params = params

    def __call__(self, received: Received, state: dict[str, torch.Tensor]) -> Finding:
        norm = weight_norm(received)
        if KEY not in state:
            return Finding({"norm": norm, "jump": 1.0}, False)
        jump = norm / max(float(state[KEY]), 1e-30)
        return Finding({"norm": norm, "jump": jump}, max(jump, 1 / max(jump, 1e-30)) > self.params.ratio)

    def remember(self, received: Received, state: dict[str, torch.Tensor]) -> None:
        """Keep the norm of a model no detector flagged as the next round's reference."""
        state[KEY] = torch.tensor(weight_norm(received), dtype=torch.float64)


@register_detector("norm-jump", params=NormJumpParams)
def build_norm_jump(params: NormJumpParams) -> NormJump:
    """Norm of the received weights against the last accepted model's"""
    return NormJump(params)
