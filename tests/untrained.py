"""The untrained MLP the attack tests invert, as the server sees it."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn as nn

from fedguard.data import ImageData, load_dataset
from fedguard.defenses import LocalStep, build_defense
from fedguard.models import build_model
from fedguard.models.mlp import MLPParams
from fedguard.observation import ModelCard, Observation
from fedguard.training import compute_gradients, get_arrays, loss_fn, trainable_mask


def untrained_mlp(
    dataset: str, params: MLPParams | None = None
) -> tuple[ImageData, nn.Module, list[np.ndarray], ModelCard]:
    """``dataset``, the MLP of ``params`` (the default: hidden 256, depth 2) initialized under torch seed 0, its
    arrays and its card."""
    params = params or MLPParams()
    data = load_dataset(dataset)
    torch.manual_seed(0)
    model = build_model("mlp", data.spec, params)
    card = ModelCard(
        "mlp", dataclasses.asdict(params), data.spec, tuple(model.state_dict()), tuple(trainable_mask(model))
    )
    return data, model, get_arrays(model), card


def batch_one_uploads(
    model: nn.Module, arrays: list[np.ndarray], card: ModelCard, x: torch.Tensor, y: torch.Tensor, defense: str, params
) -> list[Observation]:
    """Round-1 FedSGD uploads of each image of ``x`` (N, C, H, W) alone, labels ``y``, through ``defense``."""
    protect = build_defense(defense, params)
    observations = []
    for i in range(len(x)):
        grads, _ = compute_gradients(model, x[i : i + 1], y[i : i + 1])
        step = LocalStep(model, x[i : i + 1], y[i : i + 1], grads, loss_fn, torch.Generator().manual_seed(i), 1, i)
        sent = [g.numpy() for g in protect(step, {})]
        observations.append(card.observe(1, i, "gradient", arrays, sent, 1, {"batch-size": 1}))
    return observations
