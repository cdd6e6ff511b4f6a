"""The LeNet of Deep Leakage from Gradients (Zhu et al., 2019): sigmoid, no pooling."""

from __future__ import annotations

import torch
import torch.nn as nn

from fedguard.data.spec import DataSpec
from fedguard.models.registry import register_model


class LeNet(nn.Module):
    """Three 5x5 sigmoid convolutions (strides 2, 2, 1) and one linear layer.

    Sigmoid activations make the gradient twice differentiable everywhere, the
    property DLG-style attacks rely on. Weights and biases are drawn from
    U(-0.5, 0.5) as in the DLG reference; PyTorch's default initialization
    leaves the sigmoids nearly constant and the network does not train.
    """

    def __init__(self, spec: DataSpec, channels: int = 12) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(spec.channels, channels, 5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(channels, channels, 5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(channels, channels, 5, padding=2, stride=1),
            nn.Sigmoid(),
        )
        height = _halved(_halved(spec.height))
        width = _halved(_halved(spec.width))
        self.fc = nn.Linear(channels * height * width, spec.num_classes)
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.uniform_(module.weight, -0.5, 0.5)
                assert module.bias is not None  # every layer here has a bias
                nn.init.uniform_(module.bias, -0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (N, classes) of images (N, C, H, W)."""
        return self.fc(self.body(x).flatten(1))


def _halved(size: int) -> int:
    """Output size of a stride-2, padding-2, 5x5 convolution."""
    return (size + 4 - 5) // 2 + 1


@register_model("lenet")
def build_lenet(spec: DataSpec, params: object) -> nn.Module:
    """DLG LeNet (sigmoid, 3 conv + 1 linear)."""
    return LeNet(spec)
