"""ResNet-18 with the CIFAR stem (3x3 stride-1 first convolution, no max-pool)."""

from __future__ import annotations

import torch.nn as nn

from fedguard.data.spec import DataSpec
from fedguard.models.registry import register_model


@register_model("resnet18")
def build_resnet18(spec: DataSpec, params: object) -> nn.Module:
    """ResNet-18, CIFAR stem, BatchNorm (11.2M parameters for 10 classes)."""
    from torchvision.models import resnet18  # deferred: torchvision adds 0.1 GB to every process importing models

    model = resnet18(num_classes=spec.num_classes)
    model.conv1 = nn.Conv2d(spec.channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model
