"""The model registry: ``@register_model(name, params)`` on a builder."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from fedguard.data.spec import DataSpec
from fedguard.observation import Observation
from fedguard.registry import Registry

ModelBuilder = Callable[[DataSpec, Any], nn.Module]

MODELS: Registry[ModelBuilder] = Registry("model")
register_model = MODELS.register


def build_model(name: str, spec: DataSpec, params: Any = None) -> nn.Module:
    """Build the registered model ``name`` for data of shape ``spec``."""
    return MODELS.build(name, spec, params=params)


def global_model(obs: Observation) -> nn.Module:
    """The architecture of ``obs`` holding the global weights its upload was computed at (CPU, training mode)."""
    model = build_model(obs.model, obs.spec, MODELS.get(obs.model).params(**obs.model_params))
    model.load_state_dict({name: torch.tensor(array) for name, array in zip(obs.names, obs.global_arrays)})
    return model
