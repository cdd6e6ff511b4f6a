"""The ``LocalStep`` a defense's test hands it: the gradient of a batch on a model, or an update alone."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from fedguard.defenses import LocalStep
from fedguard.defenses.base import update_step
from fedguard.training import loss_fn, parameters

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def batch_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int = 0, loss: Loss = loss_fn, round_: int = 1
) -> LocalStep:
    """Client 0's FedSGD step of ``model`` on ``x`` (B, C, H, W), ``y`` (B,): the batch gradient of ``loss`` (mean
    over the batch) in training mode, with a generator seeded with ``seed``."""
    model.train()
    grads = [g.detach() for g in torch.autograd.grad(loss(model(x), y), parameters(model))]
    return LocalStep(model, x, y, grads, loss, torch.Generator().manual_seed(seed), round_, 0)


def update_only(grads: list[torch.Tensor], seed: int | torch.Generator = 0, round_: int = 0) -> LocalStep:
    """Client 0's step carrying ``grads`` alone (the model and batch a defense of updates never reads), with
    ``seed`` as its generator, or a generator seeded with it."""
    generator = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    return update_step(grads, generator, round_, 0, 0)
