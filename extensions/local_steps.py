"""A protocol of one's own, outside the fedguard package: FedSGD with k local steps.

Each client takes ``train.local-epochs`` = k SGD steps of ``train.lr``, each on its own batch of
``train.batch-size`` examples drawn without replacement from its partition, and uploads the local model (the
server averages it as FedAvg does). k = 1 is FedSGD's batch with the server's step taken by the client.

Select it from the configuration (the module must be importable: this repository's root is)::

    fedguard run experiments/quickstart.toml --set server.plugins=extensions.local_steps \\
        --set train.protocol=fedsgd-steps --set train.local-epochs=4
"""

from __future__ import annotations

import math

import numpy as np
import torch.nn as nn

from fedguard.data import Split
from fedguard.protocols import FedAvg, LocalUpdate, Schedule, register_protocol


@register_protocol("fedsgd-steps")
class LocalSteps(FedAvg):
    """FedSGD with train.local-epochs local steps, each on a fresh batch; the local model is uploaded."""

    def local_step(
        self, model: nn.Module, local: Split, schedule: Schedule, rng: np.random.Generator, proximal_mu: float = 0.0
    ) -> LocalUpdate:
        """k = ``local_epochs`` steps over ``min(len(local), k * batch_size)`` examples drawn without
        replacement, in batches of ``batch_size``; the direction is the model change ``w_global - w_local``."""
        drawn = rng.choice(len(local), size=min(len(local), schedule.local_epochs * schedule.batch_size), replace=False)
        x, y = local.batch(drawn)
        return self.train_on(model, x, y, schedule, 1, rng, proximal_mu)

    def local_steps(self, num_examples: int, batch_size: int, local_epochs: int) -> tuple[int, str]:
        """One step per batch of the examples drawn: at most ``local_epochs``."""
        steps = math.ceil(num_examples / batch_size)
        return steps, f"{steps} steps of one batch over the {num_examples} examples drawn"
