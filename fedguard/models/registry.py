"""The model registry: ``@register_model(name, params)`` on a builder."""

from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn

from fedguard.data.spec import DataSpec
from fedguard.registry import Registry

ModelBuilder = Callable[[DataSpec, Any], nn.Module]

MODELS: Registry[ModelBuilder] = Registry("model")
register_model = MODELS.register


def build_model(name: str, spec: DataSpec, params: Any = None) -> nn.Module:
    """Build the registered model ``name`` for data of shape ``spec``."""
    return MODELS.build(name, spec, params=params)
