"""What a detector sees and returns, and the detector registry.

A detector is a callable ``detector(received, state) -> Finding``: it inspects the model a client received from
the server, before the client trains on it, and scores how manipulated it looks. ``state`` is the client's dict
of tensors that survives between its rounds (the detectors' part of it: keys ``detect.<name>.*``); a detector
only reads it. A detector that keeps something across rounds also has ``remember(received, state)``, which the
client calls, writing into ``state``, only for a model no detector flagged (a manipulated model never becomes
the reference of the next round).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn as nn

from fedguard.registry import NoParams, Registry

STATE_PREFIX = "detect."  # keys of the client state that belong to the detectors


@dataclass
class Received:
    """The model a client received and the batch it checks it on.

    ``model``: at the received parameters; ``x`` (B, C, H, W) in [0, 1] and ``y`` (B,) int64: a batch of the
    client's own examples; ``loss_fn(logits, y)``: the training loss (mean over the batch)."""

    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Finding:
    """One detector's verdict on a received model: its ``scores`` by name and whether they ``flagged`` it."""

    scores: dict[str, float] = field(default_factory=dict)
    flagged: bool = False


class Detector(Protocol):
    """A check a client runs on the model it received."""

    def __call__(self, received: Received, state: dict[str, torch.Tensor]) -> Finding: ...


DetectorBuilder = Callable[[Any], Detector]

DETECTORS: Registry[DetectorBuilder] = Registry("detector")


def register_detector(name: str, params: type = NoParams) -> Callable[[DetectorBuilder], DetectorBuilder]:
    """Register the decorated builder under ``name`` with parameters ``params``."""
    return DETECTORS.register(name, params)


def build_detector(name: str, params: Any = None) -> Detector:
    """The registered detector ``name`` configured with ``params``."""
    return DETECTORS.build(name, params=params)


def weights(model: nn.Module) -> list[torch.Tensor]:
    """The model's trainable weight tensors (two or more dimensions: Linear matrices, convolution kernels), in
    parameter order, detached."""
    return [p.detach() for p in model.parameters() if p.requires_grad and p.dim() >= 2]
