"""A fully connected network."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from fedguard.data.spec import DataSpec
from fedguard.models.registry import register_model


@dataclass(frozen=True)
class MLPParams:
    """``hidden``: width of each hidden layer; ``depth``: number of hidden layers."""

    hidden: int = 256
    depth: int = 2

    def __post_init__(self) -> None:
        if self.hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {self.hidden}")
        if self.depth < 0:
            raise ValueError(f"depth must be >= 0, got {self.depth}")


@register_model("mlp", params=MLPParams)
def build_mlp(spec: DataSpec, params: MLPParams) -> nn.Module:
    """MLP: flatten, ``depth`` ReLU layers of ``hidden`` units, linear head."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = spec.channels * spec.height * spec.width
    for _ in range(params.depth):
        layers += [nn.Linear(width, params.hidden), nn.ReLU()]
        width = params.hidden
    layers.append(nn.Linear(width, spec.num_classes))
    return nn.Sequential(*layers)
