"""The batch statistics that a FedSGD upload reveals through its BatchNorm buffers (threat grant ``bn-statistics``).

A training-mode step updates each BatchNorm layer's running statistics once:
``running_new = (1 - m) * running_old + m * batch_stat``, with the layer's
momentum ``m`` (``momentum=None``: a cumulative average, ``m = 1 /
num_batches_tracked`` after the step), the batch mean for ``running_mean``
and the unbiased batch variance for ``running_var``. A FedSGD upload carries
the client's buffers after its one step, and the server knows the buffers it
sent, so it solves for every layer's batch mean and (biased) variance exactly,
up to float32 rounding amplified by ``1 / m``. Weight uploads mix the
statistics of every local step and are refused there; ``running_change``
gives what a weights upload's T steps added instead, ``sum_t m (1 - m)^(T-t)
s_t``, for an attack that replays the steps to match.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from attackers.base import images_per_upload
from fedguard.models import architecture
from fedguard.observation import Observation

BatchStatistics = dict[str, tuple[torch.Tensor, torch.Tensor]]


def observed_model(obs: Observation) -> nn.Module:
    """The architecture of ``obs`` with freshly initialized weights (only its structure is used)."""
    return architecture(obs)


def batch_norm_layers(model: nn.Module) -> dict[str, _BatchNorm]:
    """Name -> BatchNorm module, for every BatchNorm that keeps running statistics, in module order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, _BatchNorm) and m.track_running_stats}


def require_batch_norm(model: nn.Module) -> None:
    """Raise ``ValueError`` when ``model`` has no BatchNorm layer whose statistics an upload reveals (an attack
    needing them fails on every upload of it)."""
    if not batch_norm_layers(model):
        raise ValueError(
            "the model has no BatchNorm layer with running statistics: there are no batch statistics to "
            "recover (choose a BatchNorm model, e.g. convnet, resnet18 or mlp with batch-norm)"
        )


@torch.no_grad()
def values_per_channel(model: nn.Module, layers: dict[str, _BatchNorm], shape: tuple[int, ...]) -> dict[str, int]:
    """Name -> how many values one example puts into each channel of that BatchNorm (H * W for 2d, 1 for 1d)."""
    sizes: dict[str, int] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(module: _BatchNorm, inputs: tuple[torch.Tensor, ...], _: torch.Tensor) -> None:
            sizes[name] = inputs[0][0].numel() // module.num_features

        return hook

    handles = [layer.register_forward_hook(record(name)) for name, layer in layers.items()]
    try:
        model.eval()
        model(torch.zeros(1, *shape))
    finally:
        for handle in handles:
            handle.remove()
    return sizes


def sent_and_uploaded(obs: Observation) -> Callable[[str], tuple[np.ndarray, np.ndarray]]:
    """``entry -> (what the server sent, what the client uploaded)`` of a ``state_dict`` entry of ``obs``, float64."""
    index = {name: i for i, name in enumerate(obs.names)}

    def before_after(entry: str) -> tuple[np.ndarray, np.ndarray]:
        return obs.global_arrays[index[entry]].astype(np.float64), obs.upload[index[entry]].astype(np.float64)

    return before_after


def recover_batch_statistics(obs: Observation) -> BatchStatistics:
    """Each BatchNorm layer's batch mean and biased batch variance, both (channels,) float32, by module name.

    Raises ``ValueError`` for a weights upload, a model without BatchNorm running statistics, or an upload whose
    buffers are the server's own (``num_batches_tracked`` unchanged: no step counted, as under FedBN)."""
    if obs.kind != "gradient":
        raise ValueError(
            f"batch statistics are recoverable from FedSGD gradient uploads only, got a {obs.kind!r} upload"
        )
    model = observed_model(obs)
    layers = batch_norm_layers(model)
    if not layers:
        raise ValueError(
            f"model {obs.model!r} has no BatchNorm layer with running statistics: there is nothing to "
            f"recover (choose a BatchNorm model, e.g. convnet or mlp with batch-norm)"
        )
    per_example = values_per_channel(model, layers, obs.spec.shape)
    before_after = sent_and_uploaded(obs)
    batch = images_per_upload(obs)

    statistics: BatchStatistics = {}
    for name, layer in layers.items():
        tracked_before, tracked_after = before_after(f"{name}.num_batches_tracked")
        if np.array_equal(tracked_before, tracked_after):
            raise ValueError(
                f"BatchNorm {name!r} came back as the server sent it (num_batches_tracked = "
                f"{int(tracked_after)}, unchanged): the client keeps its statistics (FedBN), none to recover"
            )
        momentum = layer.momentum
        if momentum is None:
            tracked = int(tracked_after)
            if tracked < 1:
                raise ValueError(
                    f"BatchNorm {name!r} averages cumulatively but uploaded num_batches_tracked = "
                    f"{tracked}; a training step makes it >= 1"
                )
            momentum = 1.0 / tracked
        if not momentum > 0:
            raise ValueError(f"BatchNorm {name!r} has momentum {momentum}: its running statistics never see the batch")
        old_mean, new_mean = before_after(f"{name}.running_mean")
        old_var, new_var = before_after(f"{name}.running_var")
        mean = (new_mean - (1 - momentum) * old_mean) / momentum
        unbiased = (new_var - (1 - momentum) * old_var) / momentum
        n = batch * per_example[name]
        statistics[name] = (
            torch.tensor(mean, dtype=torch.float32),
            torch.tensor(unbiased * (n - 1) / n, dtype=torch.float32),
        )
    return statistics


@dataclass(frozen=True)
class RunningChange:
    """What a FedAvg client's T local steps added to one BatchNorm layer's running statistics: ``mean`` and
    ``var`` (channels,) float32, ``sum_t m (1 - m)^(T - t)`` times each step's batch mean and unbiased variance
    (the uploaded buffers less ``(1 - m)^T`` times the server's), with the layer's ``momentum`` m."""

    momentum: float
    mean: torch.Tensor
    var: torch.Tensor


def running_change(obs: Observation, steps: int) -> dict[str, RunningChange]:
    """Per BatchNorm layer (module order), the change its running statistics show after the client's ``steps``
    local steps. Raises ``ValueError`` for a gradient upload, a model without running statistics, a layer of
    cumulative averaging (``momentum=None``), or an upload whose ``num_batches_tracked`` did not advance by
    ``steps`` (the buffers kept on the client, FedBN, or another schedule than the declared one)."""
    if obs.kind != "weights":
        raise ValueError(f"the running statistics' change is read from FedAvg weight uploads, got a {obs.kind!r} one")
    layers = batch_norm_layers(observed_model(obs))
    if not layers:
        raise ValueError(f"model {obs.model!r} has no BatchNorm layer with running statistics to match")
    before_after = sent_and_uploaded(obs)
    changes: dict[str, RunningChange] = {}
    for name, layer in layers.items():
        before, after = (int(v) for v in before_after(f"{name}.num_batches_tracked"))
        if after - before != steps:
            raise ValueError(
                f"BatchNorm {name!r} counted {after - before} steps (num_batches_tracked {before} -> {after}), "
                f"but the declared local training takes {steps}: its running statistics do not follow it"
            )
        if layer.momentum is None or not 0 < layer.momentum <= 1:
            raise ValueError(
                f"BatchNorm {name!r} has momentum {layer.momentum}: only an exponential average with momentum "
                f"in (0, 1] is matched"
            )
        m = float(layer.momentum)
        decay = (1 - m) ** steps
        (old_mean, new_mean), (old_var, new_var) = (
            before_after(f"{name}.running_mean"),
            before_after(f"{name}.running_var"),
        )
        changes[name] = RunningChange(
            m,
            torch.tensor(new_mean - decay * old_mean, dtype=torch.float32),
            torch.tensor(new_var - decay * old_var, dtype=torch.float32),
        )
    return changes
