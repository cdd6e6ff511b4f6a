"""The evaluation network D of Refiner (Fan et al.): images -> predicted noise ratio in [0, 1].

Architecture of the paper's Appendix D, with the channel width as a knob:
three 3x3 stride-2 convolutions (padding 1, ReLU) of ``width``, ``2 * width``
and ``4 * width`` channels, then one linear unit and a sigmoid. The paper's
network is ``width = 128`` (128-256-512 channels, 1.49M parameters at 32x32);
the default here is smaller so that training and Refiner's per-iteration
backward pass stay cheap on a CPU. The linear layer sees the whole feature
map, so a network is tied to one image shape (``spec``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fedguard.data.spec import DataSpec


def _halved(size: int) -> int:
    """Output side of a 3x3, stride-2, padding-1 convolution."""
    return (size - 1) // 2 + 1


class EvalNet(nn.Module):
    """D: images (N, C, H, W) in [0, 1] -> noise ratio (N,) in [0, 1] (0: natural image, 1: uniform noise)."""

    def __init__(self, spec: DataSpec, width: int) -> None:
        super().__init__()
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.spec, self.width = spec, width
        height, side = spec.height, spec.width
        for _ in range(3):
            height, side = _halved(height), _halved(side)
        self.features = nn.Sequential(
            nn.Conv2d(spec.channels, width, 3, 2, 1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, 2, 1),
            nn.ReLU(),
            nn.Conv2d(2 * width, 4 * width, 3, 2, 1),
            nn.ReLU(),
            nn.Flatten(),
        )
        self.head = nn.Linear(4 * width * height * side, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.head(self.features(x))).squeeze(1)
