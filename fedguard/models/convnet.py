"""The ConvNet of Inverting Gradients (Geiping et al., 2020)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from fedguard.data.spec import DataSpec
from fedguard.models.registry import register_model


@dataclass(frozen=True)
class ConvNetParams:
    """``width``: channels of the first block; later blocks use 2x and 4x."""

    width: int = 64

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"width must be >= 1, got {self.width}")


def _block(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]


class ConvNet(nn.Module):
    """Eight 3x3 conv-BN-ReLU blocks with two 3x3 max-pools, then a linear layer.

    With ``width=64`` on 3x32x32 inputs this is the 2.9M-parameter network of
    the paper.
    """

    def __init__(self, spec: DataSpec, width: int = 64) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            *_block(spec.channels, w),
            *_block(w, 2 * w),
            *_block(2 * w, 2 * w),
            *_block(2 * w, 4 * w),
            *_block(4 * w, 4 * w),
            *_block(4 * w, 4 * w),
            nn.MaxPool2d(3),
            *_block(4 * w, 4 * w),
            *_block(4 * w, 4 * w),
            nn.MaxPool2d(3),
        )
        height, width_px = spec.height // 3 // 3, spec.width // 3 // 3
        if height < 1 or width_px < 1:
            raise ValueError(f"convnet needs images of at least 9x9 pixels, got {spec.height}x{spec.width}")
        self.fc = nn.Linear(4 * w * height * width_px, spec.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (N, classes) of images (N, C, H, W)."""
        return self.fc(self.features(x).flatten(1))


@register_model("convnet", params=ConvNetParams)
def build_convnet(spec: DataSpec, params: ConvNetParams) -> nn.Module:
    """Inverting-Gradients ConvNet (8 conv-BN-ReLU blocks, BatchNorm)."""
    return ConvNet(spec, params.width)
