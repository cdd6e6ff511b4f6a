"""The CNN of Federated Averaging (McMahan et al., AISTATS 2017), optionally with BatchNorm."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from fedguard.data.spec import DataSpec
from fedguard.models.registry import register_model


@dataclass(frozen=True)
class CNNParams:
    """``channels``: of the first 5x5 convolution (the second has twice as many); ``hidden``: units of the
    fully connected layer; ``batch_norm``: BatchNorm2d after each convolution (trained on batch statistics)."""

    channels: int = 32
    hidden: int = 512
    batch_norm: bool = False

    def __post_init__(self) -> None:
        for name in ("channels", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _block(c_in: int, c_out: int, batch_norm: bool) -> list[nn.Module]:
    norm: list[nn.Module] = [nn.BatchNorm2d(c_out)] if batch_norm else []
    return [nn.Conv2d(c_in, c_out, 5, padding=2), *norm, nn.ReLU(), nn.MaxPool2d(2)]


class CNN(nn.Module):
    """Two 5x5 convolutions (``channels``, 2x ``channels``), each with ReLU and 2x2 max-pooling, a fully connected
    ReLU layer of ``hidden`` units and a linear output; on 1x28x28 digits at the defaults, the 1.66M-parameter
    network of the FedAvg paper."""

    def __init__(self, spec: DataSpec, params: CNNParams) -> None:
        super().__init__()
        c = params.channels
        self.features = nn.Sequential(
            *_block(spec.channels, c, params.batch_norm), *_block(c, 2 * c, params.batch_norm)
        )
        height, width = spec.height // 4, spec.width // 4
        if height < 1 or width < 1:
            raise ValueError(f"cnn needs images of at least 4x4 pixels, got {spec.height}x{spec.width}")
        self.head = nn.Sequential(
            nn.Linear(2 * c * height * width, params.hidden), nn.ReLU(), nn.Linear(params.hidden, spec.num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (N, classes) of images (N, C, H, W)."""
        return self.head(self.features(x).flatten(1))


@register_model("cnn", params=CNNParams)
def build_cnn(spec: DataSpec, params: CNNParams) -> nn.Module:
    """FedAvg CNN (McMahan et al. 2017): 2 conv-(BN-)ReLU-pool blocks, a hidden fully connected layer."""
    return CNN(spec, params)
