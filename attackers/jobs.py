"""Independent attack jobs, one per (captured upload, restart), stacked on a leading dimension.

The attack engine (``attackers.engine``) runs every job of a group of
same-shaped uploads as one tensor program; this module builds what they
share: the device, the architecture (built once), the global parameters
(once when the uploads share them) and each job's seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.func import replace_all_batch_norm_modules_

from attackers.base import shape_key
from fedguard.models import global_model
from fedguard.observation import Observation


def resolve_device(name: str) -> torch.device:
    """'auto' -> CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but CUDA is not available here")
    return torch.device(name)


def stateless_model(obs: Observation, device: torch.device) -> nn.Module:
    """The observed architecture at its global model, BatchNorm on batch statistics (as in a training step)
    and without running statistics, ready for ``torch.func.functional_call``."""
    model = global_model(obs)
    replace_all_batch_norm_modules_(model)
    return model.train().to(device)


def trainable_params(obs: Observation, device: torch.device) -> dict[str, torch.Tensor]:
    """The global model's trainable parameters of ``obs`` (name -> tensor), read from the arrays."""
    return {
        name: torch.tensor(array).to(device)
        for name, array, trainable in zip(obs.names, obs.global_arrays, obs.trainable)
        if trainable
    }


def job_seed(seed: int, obs: Observation, restart: int) -> int:
    """Seed of one restart's starting point: the same whether it runs alone or batched with others."""
    return int(np.random.SeedSequence([seed, obs.round, obs.client, restart]).generate_state(1)[0])


@dataclass
class JobBatch:
    """Uploads x restarts jobs: the shared architecture and the global parameters, one set for every job
    (``shared``: the uploads were computed at one global model) or one per job (J, ...)."""

    model: nn.Module
    names: list[str]
    params: dict[str, torch.Tensor]
    restarts: int
    shared: bool

    @classmethod
    def of(cls, observations: list[Observation], restarts: int, device: torch.device) -> JobBatch:
        """Jobs for ``observations``, which must share model, data shape, image count and upload kind."""
        if len({shape_key(o) for o in observations}) > 1:
            raise ValueError("observations attacked together need one model, data shape, batch size and upload kind")
        first = observations[0]
        shared = all(
            all(np.array_equal(a, b) for a, b in zip(o.global_arrays, first.global_arrays)) for o in observations[1:]
        )
        per_upload = [trainable_params(o, device) for o in (observations[:1] if shared else observations)]
        names = list(per_upload[0])
        batch = cls(stateless_model(first, device), names, per_upload[0], restarts, shared)
        if not shared:
            batch.params = {n: batch.per_job([p[n] for p in per_upload]) for n in names}
        return batch

    def per_job(self, per_upload: list[torch.Tensor]) -> torch.Tensor:
        """One tensor per upload -> one per job (each repeated for its restarts), stacked."""
        return torch.stack(per_upload).repeat_interleave(self.restarts, dim=0)
