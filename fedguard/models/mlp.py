"""A fully connected network."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from fedguard.data.spec import DataSpec
from fedguard.limits import MAX_LAYERS
from fedguard.models.registry import register_model


@dataclass(frozen=True)
class MLPParams:
    """``hidden``: width of each hidden layer; ``depth``: number of hidden layers; ``batch_norm``: BatchNorm1d
    after the linear map of every hidden layer but the first (training then needs batches of 2 or more)."""

    hidden: int = 256
    depth: int = 2
    batch_norm: bool = False

    def __post_init__(self) -> None:
        if self.hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {self.hidden}")
        if not 0 <= self.depth <= MAX_LAYERS:
            raise ValueError(f"depth must be in 0..{MAX_LAYERS}, got {self.depth}")


@register_model("mlp", params=MLPParams)
def build_mlp(spec: DataSpec, params: MLPParams) -> nn.Module:
    """MLP: flatten, ``depth`` ReLU layers of ``hidden`` units, linear head.

    With ``batch_norm`` the hidden layers after the first are Linear -> BatchNorm1d -> ReLU. The first stays
    Linear -> ReLU: its gradient then still holds each input image in closed form (weight row / bias entry),
    which the analytic first-layer attacks of a malicious server rely on; a BatchNorm there would mix the
    batch's examples before the first ReLU."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = spec.channels * spec.height * spec.width
    for index in range(params.depth):
        layers.append(nn.Linear(width, params.hidden))
        if params.batch_norm and index > 0:
            layers.append(nn.BatchNorm1d(params.hidden))
        layers.append(nn.ReLU())
        width = params.hidden
    layers.append(nn.Linear(width, spec.num_classes))
    return nn.Sequential(*layers)
