"""The two protocols fedguard ships: FedSGD (one batch gradient) and FedAvg (local epochs, weights uploaded)."""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn as nn

from fedguard.data import Split
from fedguard.protocols.base import LocalUpdate, Protocol, Schedule
from fedguard.protocols.registry import register_protocol
from fedguard.training import compute_gradients, local_sgd, parameters
from fedguard.wire.declared import Declared


@register_protocol("fedsgd")
class FedSGD(Protocol):
    """One batch gradient per client; the server takes the SGD step."""

    upload_kind = "gradient"
    one_batch = True
    default_strategy = "fedsgd"

    def local_step(
        self, model: nn.Module, local: Split, schedule: Schedule, rng: np.random.Generator, proximal_mu: float = 0.0
    ) -> LocalUpdate:
        """The gradient of one batch of ``min(batch_size, len(local))`` examples drawn without replacement."""
        batch = rng.choice(len(local), size=min(schedule.batch_size, len(local)), replace=False)
        x, y = local.batch(batch)
        grads, loss = compute_gradients(model, x, y)
        return LocalUpdate(x, y, grads, loss, model, Declared(batch_size=len(y), loss=loss))

    def upload(self, model: nn.Module, sent: list[torch.Tensor]) -> list[np.ndarray]:
        """The defended gradient itself."""
        return [g.detach().cpu().numpy() for g in sent]


@register_protocol("fedavg")
class FedAvg(Protocol):
    """Local epochs of SGD over the client's partition; the local weights are uploaded."""

    upload_kind = "weights"
    one_batch = False
    default_strategy = "fedavg"
    defends_steps = True  # train_on follows schedule.gradient

    def local_step(
        self, model: nn.Module, local: Split, schedule: Schedule, rng: np.random.Generator, proximal_mu: float = 0.0
    ) -> LocalUpdate:
        """``local_epochs`` epochs of SGD in reshuffled batches on a copy of ``model``; the direction is the model
        change ``w_global - w_local``."""
        x, y = local.batch()
        return self.train_on(model, x, y, schedule, schedule.local_epochs, rng, proximal_mu)

    def train_on(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        schedule: Schedule,
        epochs: int,
        rng: np.random.Generator,
        proximal_mu: float,
    ) -> LocalUpdate:
        """``epochs`` epochs of SGD on (``x``, ``y``) in reshuffled batches of ``schedule.batch_size`` on a copy of
        ``model``, as the update of a client that declares ``schedule``."""
        trained = copy.deepcopy(model)
        steps, loss = local_sgd(
            trained, x, y, schedule.lr, epochs, schedule.batch_size, rng, proximal_mu=proximal_mu,
            gradient=schedule.gradient,
        )  # fmt: skip
        change = [(g - t).detach() for g, t in zip(parameters(model), parameters(trained))]
        declared = Declared(
            batch_size=min(schedule.batch_size, len(y)),
            local_epochs=schedule.local_epochs,
            local_steps=steps,
            loss=loss,
        )
        return LocalUpdate(x, y, change, loss, trained, declared)

    def upload(self, model: nn.Module, sent: list[torch.Tensor]) -> list[np.ndarray]:
        """The local model the defended change reaches: ``w_global - sent``."""
        return [(p.detach() - g).cpu().numpy() for p, g in zip(parameters(model), sent)]
