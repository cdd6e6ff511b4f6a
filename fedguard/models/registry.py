"""The model registry: ``@register_model(name, params)`` on a builder."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from fedguard.data.spec import DataSpec
from fedguard.observation import ModelCard, Observation
from fedguard.registry import Registry

ModelBuilder = Callable[[DataSpec, Any], nn.Module]

MODELS: Registry[ModelBuilder] = Registry("model")
register_model = MODELS.register


def build_model(name: str, spec: DataSpec, params: Any = None) -> nn.Module:
    """Build the registered model ``name`` for data of shape ``spec``."""
    return MODELS.build(name, spec, params=params)


def architecture(described: Observation | ModelCard) -> nn.Module:
    """The model an observation or a model card names, built with its parameters (fresh weights)."""
    return build_model(described.model, described.spec, MODELS.get(described.model).params(**described.model_params))


def model_at(described: Observation | ModelCard, arrays: list[np.ndarray]) -> nn.Module:
    """``architecture(described)`` holding ``arrays`` (its ``state_dict`` in ``described.names`` order; CPU,
    training mode)."""
    model = architecture(described)
    model.load_state_dict({name: torch.tensor(array) for name, array in zip(described.names, arrays)})
    return model


def global_model(obs: Observation) -> nn.Module:
    """The architecture of ``obs`` holding the global weights its upload was computed at (CPU, training mode)."""
    return model_at(obs, obs.global_arrays)
