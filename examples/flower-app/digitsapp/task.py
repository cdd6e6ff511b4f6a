"""The app's model, data and training: a two-layer network on scikit-learn's 8x8 digits."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
from sklearn.datasets import load_digits

from fedguard.models import register_model

EXAMPLES_PER_CLIENT = 16


class Net(nn.Module):
    """64 pixels in [0, 1] -> 64 ReLU units -> 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


@register_model("digitsapp-net")
def build_net(spec: object, params: object) -> nn.Module:
    """The app's own model, known to fedguard's attacks by this name."""
    return Net()


def load_data(
    partition_id: int, num_partitions: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(train, test) of one client: ``EXAMPLES_PER_CLIENT`` digits of its own, and the 297 held out; images
    (N, 1, 8, 8) in [0, 1], labels (N,)."""
    digits = load_digits()
    images = torch.from_numpy((digits.images / 16.0).astype(np.float32)).unsqueeze(1)
    labels = torch.from_numpy(digits.target.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(42).permutation(len(labels)))
    train, test = order[:1500], order[1500:]
    mine = torch.tensor_split(train, num_partitions)[partition_id][:EXAMPLES_PER_CLIENT]
    return (images[mine], labels[mine]), (images[test], labels[test])


def train(net: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float, batch_size: int) -> float:
    """SGD over (x, y) in shuffled batches; the last batch's loss."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    loss = torch.zeros(())
    for _ in range(epochs):
        for batch in torch.randperm(len(y)).split(batch_size):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(net(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
    return float(loss)


@torch.no_grad()
def test(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(loss, accuracy) of ``net`` on (x, y)."""
    logits = net(x)
    return float(nn.functional.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())
