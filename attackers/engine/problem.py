"""The jobs of one search: the shared architecture, each job's weights, targets, labels and search space."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from attackers.base import Reconstruction, images_per_upload
from attackers.bn_statistics import recover_batch_statistics, running_change
from attackers.engine.local_schedule import LocalSchedule
from attackers.engine.spaces import EpochCopiesSpace, JointSpace, LatentSpace, PixelSpace, RobustMixtureSpace, Space
from attackers.engine.spec import SearchSpec
from attackers.engine.terms import Statistics
from attackers.jobs import JobBatch, job_seed
from attackers.labels import declared_labels, upload_labels_inferred
from fedguard.defenses.revealed import Revealed, SentBand, TowardsRobustData
from fedguard.observation import Observation

UPLOAD_NAMES = {"gradient": "FedSGD gradients", "weights": "FedAvg weights"}
MAX_ROBUST_SHARE = 0.5
"""The largest share of the robust images' gradient in a Refiner upload the search allows: below it the true
images weigh more than the robust ones, which tells the two halves apart (``c = r / ||g* - g||`` measured 0.18
to 0.39 in the defenses sweep)."""


def target_gradient(obs: Observation, device: torch.device) -> list[torch.Tensor]:
    """The uploaded gradient of each trainable parameter (FedSGD uploads only)."""
    if obs.kind != "gradient":
        raise ValueError(f"this attack needs FedSGD gradients, got a {obs.kind!r} upload")
    return [torch.tensor(a).to(device) for a, t in zip(obs.upload, obs.trainable) if t]


def target_update(obs: Observation, device: torch.device) -> list[torch.Tensor]:
    """Per trainable parameter: the gradient (FedSGD), or ``global - uploaded`` weights (FedAvg)."""
    if obs.kind == "gradient":
        return target_gradient(obs, device)
    return [torch.tensor(g - u).to(device) for g, u, t in zip(obs.global_arrays, obs.upload, obs.trainable) if t]


def space_for(
    obs: Observation,
    batch: int,
    joint: bool,
    decoder: Any,
    device: torch.device,
    matching: Revealed | None = None,
    shuffle: str = "in-order",
) -> Space:
    """The search space: a generator's latents (``decoder``), images with soft labels (``joint``), images and
    Refiner's robust images (``matching`` is ``TowardsRobustData``), one copy of the images per local epoch
    (``shuffle`` 'per-epoch', FedAvg uploads), or images."""
    shape = obs.spec.shape
    if shuffle == "per-epoch" and obs.kind == "weights":
        if decoder is not None or joint or matching is not None:
            raise ValueError(
                "the replay with the shuffle searched (shuffle = 'per-epoch') assigns known or inferred labels to "
                "pixel images: it takes no generator, no joint labels and no defense's matching"
            )
        return EpochCopiesSpace(LocalSchedule.of(obs).epochs, batch, shape, obs.spec.num_classes)
    if isinstance(matching, TowardsRobustData):
        if decoder is not None or joint or obs.kind != "gradient":
            raise ValueError(
                "the attack on Refiner's uploads searches images and robust images of known or inferred labels "
                "behind FedSGD gradients: it takes no generator, no joint labels and no FedAvg upload"
            )
        return RobustMixtureSpace(batch, shape, MAX_ROBUST_SHARE)
    if decoder is not None:
        if decoder.spec.shape != shape:
            raise ValueError(
                f"the generator makes images of shape {decoder.spec.shape}, but the uploads come from "
                f"images of shape {shape}; train one on similar data with "
                f"`fedguard train-generator --data <dataset>`"
            )
        return LatentSpace(batch, decoder.latent_dim, decoder.to(device), shape)
    if joint:
        return JointSpace(batch, shape, obs.spec.num_classes)
    return PixelSpace(batch, shape)


class Problem:
    """The jobs of one search: model, weights (shared or per job), targets of the compared parameters (J, ...)
    each, labels (known per upload, or searched), the space, the images per upload (``examples``), and the
    BatchNorm layers a ``bn`` or ``running-stats`` term matches with their target statistics (J, C) (the
    ``running_momenta`` of those layers for ``running-stats``, else empty)."""

    def __init__(
        self,
        spec: SearchSpec,
        observations: list[Observation],
        jobs: JobBatch,
        target: list[torch.Tensor],
        known: list[torch.Tensor] | None,
        inferred: list[bool],
        space: Space,
        bn_layers: list[str],
        bn_target: Statistics,
        examples: int,
        running_momenta: list[float],
    ) -> None:
        self.spec, self.observations, self.batch_of_jobs = spec, observations, jobs
        self.target, self.known, self.inferred, self.space = target, known, inferred, space
        self.bn_layers, self.bn_target = bn_layers, bn_target
        self.examples, self.running_momenta = examples, running_momenta
        self.jobs = len(observations) * spec.restarts
        self.y = jobs.per_job(known) if known is not None else None

    @classmethod
    def of(cls, spec: SearchSpec, observations: list[Observation], device: torch.device, decoder: Any) -> Problem:
        first = observations[0]
        for obs in observations:
            if obs.kind not in spec.uploads:
                wanted = " or ".join(UPLOAD_NAMES[k] for k in sorted(spec.uploads))
                raise ValueError(f"this attack needs {wanted}, got a {obs.kind!r} upload")
        batch = images_per_upload(first)
        bn_stats = [recover_batch_statistics(o) for o in observations] if spec.uses("bn") else []
        momenta: list[float] = []
        if spec.uses("running-stats"):
            if first.kind != "weights":
                raise ValueError(
                    "the running-stats term matches the running statistics of FedAvg weight uploads; a FedSGD "
                    "upload's batch statistics are matched by the bn term"
                )
            steps = LocalSchedule.of(first).steps(batch)
            changes = [running_change(o, steps) for o in observations]
            bn_stats = [{name: (c.mean, c.var) for name, c in change.items()} for change in changes]
            momenta = [c.momentum for c in changes[0].values()]
        jobs = JobBatch.of(observations, spec.restarts, device)
        targets = [target_update(o, device) for o in observations]
        declared = [declared_labels(o.declared) for o in observations]
        joint = spec.labels == "joint" and any(lab is None for lab in declared)
        sparse = isinstance(spec.matching, SentBand)
        known = (
            None
            if joint
            else [
                (upload_labels_inferred(o, t, batch, sparse) if lab is None else lab).to(device)
                for o, lab, t in zip(observations, declared, targets)
            ]
        )
        inferred = [lab is None and not joint for lab in declared]
        compared = [i for i, n in enumerate(jobs.names) if not spec.skipped(n)]
        if not compared:
            raise ValueError(
                f"skip = {spec.skip!r} leaves no parameter to compare; parameters: {', '.join(jobs.names)}"
            )
        target = [jobs.per_job([t[i] for t in targets]) for i in compared]
        space = space_for(first, batch, joint, decoder, device, spec.matching, spec.shuffle)
        layers = list(bn_stats[0]) if bn_stats else []
        bn_target = [
            (
                jobs.per_job([s[name][0].to(device) for s in bn_stats]),
                jobs.per_job([s[name][1].to(device) for s in bn_stats]),
            )
            for name in layers
        ]
        return cls(spec, observations, jobs, target, known, inferred, space, layers, bn_target, batch, momenta)

    def generator(self, seed: int, job: int, attempt: int = 0) -> torch.Generator:
        """The seeded generator of one job's ``attempt``-th starting point."""
        obs = self.observations[job // self.spec.restarts]
        return torch.Generator().manual_seed(job_seed(seed + attempt, obs, job % self.spec.restarts))

    def fresh_starts(self, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """``jobs (J,) bool -> (J, ...)`` new starting points (a job's n-th restart after a non-finite point)."""
        attempts = [0] * self.jobs

        def fresh(jobs: torch.Tensor) -> torch.Tensor:
            points = []
            for job, again in enumerate(jobs.tolist()):
                attempts[job] += int(again)
                points.append(self.space.start(self.generator(seed, job, attempts[job])))
            return torch.stack(points)

        return fresh

    @property
    def labels_per_job(self) -> bool:
        """Whether ``final_labels`` gives each job's labels (searched or assigned) rather than each upload's."""
        return self.known is None or isinstance(self.space, EpochCopiesSpace)

    def final_labels(self, z: torch.Tensor) -> list[torch.Tensor]:
        """The known labels of each upload, the ones each job's copy 0 assigns to its images, or the searched
        ones of each job."""
        if isinstance(self.space, EpochCopiesSpace) and self.y is not None:
            return list(self.space.final_labels(z, self.y))
        if self.known is not None:
            return self.known
        return list(cast(JointSpace, self.space).final_labels(z))  # labels are searched in the joint space only

    def reconstructions(
        self,
        z: torch.Tensor,
        final: torch.Tensor,
        parts: dict[str, torch.Tensor],
        images: torch.Tensor,
        labels: list[torch.Tensor],
        resets: torch.Tensor,
        seconds: float,
    ) -> list[Reconstruction]:
        """Per upload, its best restart's images and labels, with the search's statistics (``z``: the end
        points)."""
        spec = self.spec
        uploads, restarts = len(self.observations), spec.restarts
        final = final.reshape(uploads, restarts)
        best = final.argmin(1)
        results = []
        for i in range(uploads):
            job = i * restarts + int(best[i])
            upload_labels = labels[job] if self.labels_per_job else labels[i]
            stats: dict[str, Any] = {
                "loss": float(final[i, best[i]]),
                "restart_losses": [float(v) for v in final[i]],
                "iterations": spec.iterations,
                "restarts": restarts,
                "batched_jobs": self.jobs,
                "shared_weights": self.batch_of_jobs.shared,
                "seconds": seconds / uploads,
                "labels_inferred": self.inferred[i],
                **{f"{name}_term": float(value[job]) for name, value in parts.items()},
            }
            if isinstance(self.space, RobustMixtureSpace):
                stats["robust_share"] = float(self.space.robust_share(z)[job])
            if spec.optimizer.kind == "lbfgs":
                stats["nan_restarts"] = int(resets[i * restarts : (i + 1) * restarts].sum())
            results.append(Reconstruction(images[job].cpu(), upload_labels.cpu(), stats))
        return results
