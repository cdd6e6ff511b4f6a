"""FedBN (Li et al., ICLR 2021): every BatchNorm layer stays on the client (``train.fedbn``).

Each BatchNorm module's entries (``weight``, ``bias``, ``running_mean``, ``running_var``,
``num_batches_tracked``) are the client's own: kept in its state between rounds (``KEY_PREFIX`` + name), loaded
into the model it receives before it trains, updated by its own step, and never sent. The wire format keeps every
``state_dict`` entry, so what the server receives at those places is what it sent: the global weights and
buffers of a weight upload, a zero gradient and the global buffers of a gradient upload. The mean of any round is
then the global BatchNorm unchanged, as Flower's FedBN how-to leaves it: the server aggregates the other layers
only. A defense sees the other layers' direction only (the BatchNorm entries of what it is given are zero: a clip
measures the rest), and whatever it puts at those entries (noise) is not sent.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from fedguard.protocols.base import UploadKind

KEY_PREFIX = "fedbn."  # the client's state entries that hold its BatchNorm layers


def batch_norm_names(model: nn.Module) -> set[str]:
    """The ``state_dict`` names of every BatchNorm module's parameters and buffers."""
    modules = [name for name, module in model.named_modules() if isinstance(module, _BatchNorm)]
    return {key for key in model.state_dict() if any(key.startswith(f"{m}.") for m in modules)}


def load_local(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put the client's own BatchNorm entries of ``state`` into ``model`` (none before its first round: it starts
    from the global ones)."""
    own = {key.removeprefix(KEY_PREFIX): value for key, value in state.items() if key.startswith(KEY_PREFIX)}
    if own:
        current = model.state_dict()
        model.load_state_dict({**current, **{k: v.to(current[k].dtype) for k, v in own.items()}})


def after_step(
    model: nn.Module,
    direction: list[torch.Tensor],
    buffers_after: list[np.ndarray],
    kind: UploadKind,
    lr: float,
) -> dict[str, torch.Tensor]:
    """The client's BatchNorm entries after its step, as state entries: each parameter moved by the step from its
    value in ``model`` (the model the step started from): ``w - d`` for a weight protocol's direction
    ``d = w_start - w_local``, ``w - lr * g`` for a gradient protocol's; each buffer as the step left it
    (``buffers_after``, the buffer entries in ``state_dict`` order)."""
    names, trainable = batch_norm_names(model), {name for name, p in model.named_parameters() if p.requires_grad}
    steps, buffers = iter(direction), iter(buffers_after)
    kept: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        moved = next(steps) if name in trainable else torch.as_tensor(next(buffers))
        if name not in names:
            continue
        if name in trainable:
            moved = value.detach() - (moved if kind == "weights" else lr * moved)
        kept[f"{KEY_PREFIX}{name}"] = moved.detach().to(value.dtype).clone()
    return kept


def without_batch_norm(model: nn.Module, direction: list[torch.Tensor]) -> list[torch.Tensor]:
    """``direction`` (one tensor per trainable parameter) with the BatchNorm parameters' entries zero."""
    names, trainable = batch_norm_names(model), {name for name, p in model.named_parameters() if p.requires_grad}
    ordered = [name for name in model.state_dict() if name in trainable]
    return [torch.zeros_like(d) if name in names else d for name, d in zip(ordered, direction)]


def as_sent_back(
    model: nn.Module, upload: list[np.ndarray], received: list[np.ndarray], kind: UploadKind
) -> list[np.ndarray]:
    """``upload`` (``state_dict`` order) with every BatchNorm entry what the server sent (``received``): its
    weights and buffers, or for a gradient upload a zero gradient of its parameters."""
    names = batch_norm_names(model)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    sent = []
    for name, array, original in zip(model.state_dict(), upload, received):
        if name not in names:
            sent.append(array)
        elif name in trainable and kind == "gradient":
            sent.append(np.zeros_like(array))
        else:
            sent.append(np.array(original, dtype=array.dtype, copy=True))
    return sent
