"""The untrained MLP the attack tests invert, as the server sees it."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from fedguard.data import ImageData, load_dataset
from fedguard.models import build_model
from fedguard.observation import ModelCard
from fedguard.training import get_arrays, trainable_mask


def untrained_mlp(dataset: str) -> tuple[ImageData, nn.Module, list[np.ndarray], ModelCard]:
    """``dataset``, the default MLP (hidden 256, depth 2) initialized under torch seed 0, its arrays and its card."""
    data = load_dataset(dataset)
    torch.manual_seed(0)
    model = build_model("mlp", data.spec)
    card = ModelCard(
        "mlp", {"hidden": 256, "depth": 2}, data.spec, tuple(model.state_dict()), tuple(trainable_mask(model))
    )
    return data, model, get_arrays(model), card
