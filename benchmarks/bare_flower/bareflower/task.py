"""The model, the data and the client's step, shared by the ServerApp and the ClientApp.

The MLP is fedguard's default ``mlp`` (``fedguard/models/mlp.py`` with ``hidden=256, depth=2``, no BatchNorm),
copied layer for layer: the same ``state_dict`` names and shapes, and the same weights from the same seed
(``torch.manual_seed(seed)`` then construction, as fedguard's ServerApp does). It is copied rather than imported
because ``fedguard.models`` imports torchvision and fedguard's attack models, which a bare app would not load.
The data and its partitioning are fedguard's own loaders (``fedguard.data``), so every client holds the very
examples it holds in a fedguard run.

The client's step is the one fedguard's FedSGD client takes (``clients/defended_client.py``): the batch is
drawn as fedguard draws it (``fedguard.seeding.client_generators(seed, client, round)`` and the same
``rng.choice``), the gradient of its mean cross-entropy is taken in training mode, and with ``defense = "dgp"``
it goes through fedguard's Dual Gradient Pruning with error feedback (``fedguard.defenses.dgp``,
``DGPParams()`` defaults, the algorithm alone) given the same ``LocalStep`` fields fedguard gives it (torch
generator, round, client, examples held). The residual is kept where a Flower user keeps per-client state: in
the node's ``Context.state``, as one ``ArrayRecord`` (``RESIDUAL_KEY``). The client then returns the model after
one SGD step with what was sent; Flower's FedAvg of those models is FedSGD.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from flwr.app import ArrayRecord, RecordDict

from fedguard.data import load_dataset
from fedguard.data.federated import client_split
from fedguard.data.partition import PartitionOptions
from fedguard.data.registry import SourceOptions
from fedguard.defenses.base import LocalStep
from fedguard.defenses.dgp import DGPParams, DualGradientPruning
from fedguard.seeding import client_generators

HIDDEN, DEPTH = 256, 2  # fedguard's model.mlp defaults
DEFENSES = ("dgp", "none")
RESIDUAL_KEY = "dgp-residual"  # the ArrayRecord in Context.state holding the DGP residual, one array per layer


def mlp(channels: int, height: int, width: int, num_classes: int) -> nn.Sequential:
    """fedguard's ``mlp``: flatten, ``DEPTH`` ReLU layers of ``HIDDEN`` units, linear head."""
    layers: list[nn.Module] = [nn.Flatten()]
    size = channels * height * width
    for _ in range(DEPTH):
        layers += [nn.Linear(size, HIDDEN), nn.ReLU()]
        size = HIDDEN
    layers.append(nn.Linear(size, num_classes))
    return nn.Sequential(*layers)


def source_options(run_config: dict[str, Any]) -> SourceOptions:
    return SourceOptions(
        str(run_config["data-root"]), False, float(run_config["test-fraction"]), int(run_config["image-size"])
    )


def dataset(run_config: dict[str, Any]):  # -> fedguard.data.dataset.ImageData (cached by fedguard)
    return load_dataset(str(run_config["data-name"]), source_options(run_config))


def build_model(run_config: dict[str, Any], seed: int | None = None) -> nn.Sequential:
    """The MLP for the run's data; seeded as fedguard seeds its initial model when ``seed`` is given."""
    spec = dataset(run_config).spec
    if seed is not None:
        torch.manual_seed(seed)
    return mlp(spec.channels, spec.height, spec.width, spec.num_classes)


@functools.lru_cache(maxsize=1)
def _cached_model(key: tuple[tuple[str, Any], ...]) -> nn.Sequential:
    return build_model(dict(key))


def process_model(run_config: dict[str, Any]) -> nn.Sequential:
    """One model instance per process (an actor runs many clients); weights are loaded every round."""
    return _cached_model(
        tuple(
            sorted(
                (k, v) for k, v in run_config.items() if k.startswith("data-") or k in ("test-fraction", "image-size")
            )
        )
    )


def local_split(run_config: dict[str, Any], partition_id: int, num_partitions: int):  # -> Split
    """This client's training examples: fedguard's iid partition (cached per process by fedguard)."""
    return client_split(
        str(run_config["data-name"]),
        source_options(run_config),
        "iid",
        PartitionOptions(0.5, 2),
        num_partitions,
        int(run_config["seed"]),
        partition_id,
    )


def client_batch(
    size: int, batch_size: int, seed: int, client: int, server_round: int
) -> tuple[np.ndarray, torch.Generator]:
    """The positions of the batch a client of ``size`` examples takes in ``server_round``, drawn as fedguard's
    client draws them, and the torch generator fedguard hands its defense (both from (seed, client, round))."""
    rng, generator = client_generators(seed, client, server_round)
    return rng.choice(size, size=min(batch_size, size), replace=False), generator


def gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[list[torch.Tensor], float]:
    """Gradient of the mean cross-entropy of (x, y) w.r.t. every trainable parameter, in training mode, and
    the loss (as ``fedguard.training.compute_gradients``)."""
    model.train()
    loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return [g.detach() for g in grads], float(loss.detach())


@functools.lru_cache(maxsize=1)
def dgp() -> DualGradientPruning:
    """fedguard's DGP with its default parameters (k1 = 5 %, k2 = 75 %, error feedback on everything unsent)."""
    return DualGradientPruning(DGPParams())


def load_residual(state: RecordDict) -> dict[str, torch.Tensor]:
    """The DGP residual kept in a node's ``Context.state`` (empty before the client's first round)."""
    return dict(state[RESIDUAL_KEY].to_torch_state_dict()) if RESIDUAL_KEY in state else {}


def store_residual(state: RecordDict, residual: dict[str, torch.Tensor]) -> None:
    """Keep the DGP residual in a node's ``Context.state`` for the client's next round."""
    state[RESIDUAL_KEY] = ArrayRecord(torch_state_dict={k: v.detach().contiguous() for k, v in residual.items()})


def defended_gradients(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    defense: str,
    state: RecordDict,
    generator: torch.Generator,
    server_round: int,
    client: int,
    examples: int,
) -> tuple[list[torch.Tensor], float]:
    """What the client sends (one tensor per trainable parameter) and the loss: the batch gradient, through
    DGP with error feedback when ``defense`` is "dgp" (residual read from and written back to ``state``)."""
    grads, loss = gradients(model, x, y)
    if defense == "none":
        return grads, loss
    if defense != "dgp":
        raise ValueError(f"defense {defense!r}: the bare app knows {', '.join(DEFENSES)}")
    residual = load_residual(state)
    step = LocalStep(model, x, y, grads, F.cross_entropy, generator, server_round, client, examples)
    sent = dgp()(step, residual)
    store_residual(state, residual)
    return sent, loss


@torch.no_grad()
def sgd_step(model: nn.Module, grads: list[torch.Tensor], lr: float) -> None:
    """``p -= lr * g`` for every trainable parameter, in place."""
    for p, g in zip([p for p in model.parameters() if p.requires_grad], grads):
        p.sub_(lr * g)
