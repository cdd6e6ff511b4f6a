"""What a protocol is: a client's local step and the upload it makes of what the defense sent."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np
import torch
import torch.nn as nn

from fedguard.data import Split
from fedguard.training import StepGradient
from fedguard.wire.declared import Declared

UploadKind = Literal["gradient", "weights"]  # fedguard.observation.UPLOAD_KINDS: what an observation holds


@dataclass(frozen=True)
class Schedule:
    """The run's ``train.*`` values a local step reads: ``lr``, ``batch_size`` (samples per batch, at most) and
    ``local_epochs``; ``gradient``: what every local step follows in place of its batch's gradient, for a
    defense of every step (``DefenseTraits.defends_steps``; None: the batch's gradient), honoured by a protocol
    whose ``defends_steps`` says so."""

    lr: float
    batch_size: int
    local_epochs: int
    gradient: StepGradient | None = None


@dataclass
class LocalUpdate:
    """What one client's local step produced.

    ``x``, ``y``: the examples it used (the true batch a captured upload is scored against); ``direction``: one
    tensor per trainable parameter, what the defense transforms (the batch gradient, or the model change
    ``w_global - w_local``); ``loss``: the last cross-entropy; ``buffers_from``: the model whose buffers (BatchNorm
    statistics) travel with the upload; ``declared``: the protocol's fields of the upload's declared record."""

    x: torch.Tensor
    y: torch.Tensor
    direction: list[torch.Tensor]
    loss: float
    buffers_from: nn.Module
    declared: Declared = field(default_factory=Declared)


class Protocol(ABC):
    """One federated protocol. Subclasses set the class attributes and implement the two methods.

    ``upload_kind``: what an upload holds, ``gradient`` (one per trainable parameter) or ``weights`` (the local
    model); ``one_batch``: an upload is one batch, so its examples equal its declared batch size, at most
    ``train.batch-size``; ``default_strategy``: the ``server.strategy`` that ``auto`` stands for;
    ``defends_steps``: its local training follows ``schedule.gradient`` at every step, so that a defense of every
    step (DP-SGD) can run under it."""

    name: ClassVar[str]
    upload_kind: ClassVar[UploadKind]
    one_batch: ClassVar[bool]
    default_strategy: ClassVar[str]
    defends_steps: ClassVar[bool] = False

    @abstractmethod
    def local_step(
        self,
        model: nn.Module,
        local: Split,
        schedule: Schedule,
        rng: np.random.Generator,
        proximal_mu: float = 0.0,
    ) -> LocalUpdate:
        """One round's local work on ``local`` (the client's partition) from the global ``model``, which is left
        as it came; ``proximal_mu`` is FedProx's weight, sent by the server (0: none)."""

    @abstractmethod
    def upload(self, model: nn.Module, sent: list[torch.Tensor]) -> list[np.ndarray]:
        """The trainable arrays uploaded, from the global ``model`` and the defended ``sent`` direction."""

    def local_steps(self, num_examples: int, batch_size: int, local_epochs: int) -> tuple[int, str]:
        """The SGD steps a client of ``num_examples`` takes in a round, what the server checks a declared
        ``local-steps`` against, and how they come about: one pass over the examples in batches of ``batch_size``
        per local epoch."""
        batches = math.ceil(num_examples / batch_size)
        return local_epochs * batches, f"{local_epochs} epochs of {batches} batches"
