"""Independent attack jobs, one per (captured upload, restart), stacked on a leading dimension.

Optimization attacks run every job of a group of same-shaped uploads as one
tensor program; this module builds what they share: the device, the
architecture (built once), each job's parameters and seeded starting points.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.func import replace_all_batch_norm_modules_

from attackers.base import images_per_upload, shape_key
from attackers.labels import declared_labels, upload_labels_inferred
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
    """Uploads x restarts jobs: the shared architecture and each job's global parameters (J, ...)."""

    model: nn.Module
    names: list[str]
    params: dict[str, torch.Tensor]
    restarts: int

    @classmethod
    def of(cls, observations: list[Observation], restarts: int, device: torch.device) -> "JobBatch":
        """Jobs for ``observations``, which must share model, data shape, image count and upload kind."""
        if len({shape_key(o) for o in observations}) > 1:
            raise ValueError("observations attacked together need one model, data shape, batch size and upload kind")
        per_upload = [trainable_params(o, device) for o in observations]
        names = list(per_upload[0])
        batch = cls(stateless_model(observations[0], device), names, {}, restarts)
        batch.params = {n: batch.per_job([p[n] for p in per_upload]) for n in names}
        return batch

    def per_job(self, per_upload: list[torch.Tensor]) -> torch.Tensor:
        """One tensor per upload -> one per job (each repeated for its restarts), stacked."""
        return torch.stack(per_upload).repeat_interleave(self.restarts, dim=0)


@dataclass
class JobTargets:
    """What the jobs of a ``JobBatch`` match: ``target`` per trainable parameter (J, ...), labels ``y`` (J, B)
    int64; per upload its ``labels`` (B,) and whether they were ``inferred``; ``batch``, images per upload."""

    target: list[torch.Tensor]
    y: torch.Tensor
    labels: list[torch.Tensor]
    inferred: list[bool]
    batch: int


def job_targets(
    jobs: JobBatch, observations: list[Observation], targets: list[list[torch.Tensor]],
    labels: list[torch.Tensor | None] | None,
) -> JobTargets:
    """Per job, the upload's ``targets`` (one list per upload, in parameter order) and its labels: ``labels`` if
    given, else those the client declared (threat model ``labels``), else inferred from its target."""
    first = observations[0]
    batch = images_per_upload(first)
    if labels is None:
        labels = [declared_labels(o.declared) for o in observations]
    inferred = [lab is None for lab in labels]
    known = [upload_labels_inferred(o, t, batch) if lab is None else lab
             for o, lab, t in zip(observations, labels, targets)]
    device = targets[0][0].device
    target = [jobs.per_job([t[i] for t in targets]) for i in range(len(jobs.names))]
    return JobTargets(target, jobs.per_job([lab.to(device) for lab in known]), known, inferred, batch)
