"""GradInversion (Yin et al., "See through Gradients: Image Batch Recovery via GradInversion", CVPR 2021).

Threat model: an honest server that also knows each BatchNorm layer's batch
mean and variance (grant ``bn-statistics``); on FedSGD uploads it reads them
off the uploaded buffers (``attackers.bn_statistics``). Labels come from the
last layer's gradient (``attackers.labels``) unless the client declared them.

Per job (one upload, one restart) it minimizes over dummy images ``x`` (B, C, H, W) in [0, 1]::

    gradient * sum_l ||grad_l(x) - g_l||^2 / sum_l ||g_l||^2          (L_grad)
    + tv * TV(x) + l2 * mean((x - 0.5)^2)                            (image prior)
    + bn * sum_l (||mu_l(x) - mu_l||_2 + ||var_l(x) - var_l||_2)     (BatchNorm statistics)
    + group * mean((x - mean over restarts of x)^2)                  (group consistency)

L_grad sums the squared distance over every parameter tensor ``l`` with one
weight (the paper's per-layer weights all equal), divided by the uploaded
gradient's squared norm so that the weights do not depend on the model's
gradient scale (1 for a zero dummy gradient). ``TV`` is
``attackers.inverting_gradients.total_variation`` averaged over the batch.
The paper's l2 prior acts on normalized images, i.e. pulls towards the data
mean; on raw [0, 1] pixels its analogue pulls towards mid-grey. ``mu_l`` and
``var_l`` are the per-channel mean and biased variance of BatchNorm layer
``l``'s input; the dummy batch's come from the forward pass that yields its
gradient (forward hooks on the BatchNorm modules, inside the vmapped
function). The group term, on from ``group_start`` (a fraction of the
iterations), pulls every restart of one upload towards their mean (detached,
recomputed each iteration); the paper first registers the restarts to each
other, here the plain mean is used: with the sorted labels fixing each
position's class, restarts mostly agree on which image sits where.

Optimizer: Adam (as the paper), step ``lr`` on [0, 1] pixels with cosine
decay to 0 over the iterations, pixels clamped to [0, 1] after each step.
The best restart of each upload is the one with the lowest final loss
without the group term. Defaults are for small images and small BatchNorm
networks (the paper inverts ResNet-50 gradients of 224x224 ImageNet batches,
with many more iterations): on randomly initialized BatchNorm networks gradient matching
alone stalls, and ``bn`` = 1 (the BatchNorm term about as heavy as L_grad)
is what lets it converge; ``tv`` and ``l2`` are the small image priors of
DeepInversion-style attacks; ``group`` = 0.01 from half-way on.

As in ``attackers.inverting_gradients``, all restarts of all uploads given
together run as one tensor program (``torch.func.vmap`` over jobs of the
parameter gradient, one ``torch.func.grad`` w.r.t. every dummy image); only
restarts of the same upload interact, through the group term. Nothing in the
loop synchronizes with the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

from attackers.base import Reconstruction, check_search_params, class_traits, register_attack
from attackers.bn_statistics import recover_batch_statistics
from attackers.inverting_gradients import target_gradient, total_variation
from attackers.jobs import JobBatch, job_seed, job_targets, resolve_device
from fedguard.observation import Observation
from fedguard.training import loss_fn

Statistics = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class GradInversionParams:
    """Iterations, restarts (a group per upload), Adam step on [0, 1] pixels (cosine decay), device ('auto',
    'cpu', 'cuda'); loss weights: ``gradient`` (squared L2 gradient distance over the upload's squared norm),
    ``tv``, ``l2`` (pixels' squared distance to 0.5), ``bn`` (BatchNorm statistics distance), ``group`` (distance to the restarts' mean), on from
    ``group_start`` (fraction of the iterations, in [0, 1])."""

    iterations: int = 2000
    restarts: int = 4
    lr: float = 0.1
    device: str = "auto"
    gradient: float = 1.0
    tv: float = 1e-4
    l2: float = 1e-6
    bn: float = 1.0
    group: float = 0.01
    group_start: float = 0.5

    def __post_init__(self) -> None:
        check_search_params(self.iterations, self.restarts, self.lr, self.device)
        for name in ("gradient", "tv", "l2", "bn", "group"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.group_start <= 1:
            raise ValueError(f"group_start must be a fraction of the iterations in [0, 1], got {self.group_start}")


class BatchNormInputs:
    """Forward hooks that record, per named BatchNorm module, the per-channel mean and biased variance of its
    input during the latest forward pass (works inside ``torch.func`` transforms)."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        modules = dict(model.named_modules())
        self.names = names
        self.seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.handles = [modules[name].register_forward_hook(self._hook(name)) for name in names]

    def _hook(self, name: str) -> Callable[..., None]:
        def record(module: nn.Module, inputs: tuple[torch.Tensor, ...], _: torch.Tensor) -> None:
            h = inputs[0]
            dims = [0, *range(2, h.dim())]
            self.seen[name] = (h.mean(dims), h.var(dims, correction=0))
        return record

    def statistics(self) -> Statistics:
        """(mean, variance) per module, (channels,) each, in ``names`` order."""
        return [self.seen[name] for name in self.names]

    def remove(self) -> None:
        """Detach the hooks from the model."""
        for handle in self.handles:
            handle.remove()


class GradInversion:
    """Gradient matching with image, BatchNorm and group-consistency priors, batched over restarts and uploads."""

    needs: frozenset[str] = frozenset({"bn-statistics"})
    uploads: frozenset[str] = frozenset({"gradient"})
    manipulation = "none"

    def __init__(self, params: GradInversionParams) -> None:
        self.params = params

    def reconstruct(self, obs: Observation, labels: torch.Tensor | None = None) -> Reconstruction:
        """Reconstruct the batch behind one upload."""
        return self.reconstruct_many([obs], None if labels is None else [labels])[0]

    def reconstruct_many(
        self, observations: list[Observation], labels: list[torch.Tensor | None] | None = None, seed: int = 0
    ) -> list[Reconstruction]:
        """Reconstruct several uploads of one architecture and batch size in one batched run.

        Labels: ``labels`` if given, else those the client declared (threat model ``labels``), else inferred."""
        if not observations:
            return []
        first, p = observations[0], self.params
        device = resolve_device(p.device)
        start = time.perf_counter()
        uploads, restarts = len(observations), p.restarts
        bn_targets = [recover_batch_statistics(o) for o in observations]
        jobs_of = JobBatch.of(observations, restarts, device)
        model, names, params, stack = jobs_of.model, jobs_of.names, jobs_of.params, jobs_of.per_job
        matched = job_targets(jobs_of, observations, [target_gradient(o, device) for o in observations], labels)
        batch, inferred, labels = matched.batch, matched.inferred, matched.labels
        target, y = matched.target, matched.y
        target_energy = sum((t.flatten(1) ** 2).sum(1) for t in target).clamp_min(1e-12)
        layers = list(bn_targets[0])
        bn_target = [tuple(stack([s[name][k].to(device) for s in bn_targets]) for k in (0, 1)) for name in layers]
        recorder = BatchNormInputs(model, layers)

        def job_forward(
            q: dict[str, torch.Tensor], x: torch.Tensor, yy: torch.Tensor
        ) -> tuple[dict[str, torch.Tensor], Statistics]:
            """One job's parameter gradient and its dummy batch's BatchNorm statistics, from one forward pass."""
            def loss_and_statistics(r: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Statistics]:
                return loss_fn(functional_call(model, r, (x,)), yy), recorder.statistics()

            return grad(loss_and_statistics, has_aux=True)(q)

        def job_losses(x: torch.Tensor, centre: torch.Tensor, group: float) -> tuple[torch.Tensor, torch.Tensor]:
            """(J,) losses and (J,) BatchNorm distances of dummy batches ``x`` (J, B, C, H, W)."""
            g, statistics = vmap(job_forward)(params, x, y)
            distance = sum(((g[n] - t) ** 2).flatten(1).sum(1) for n, t in zip(names, target)) / target_energy
            bn = sum(torch.linalg.vector_norm(mean - mean_t, dim=1) + torch.linalg.vector_norm(var - var_t, dim=1)
                     for (mean, var), (mean_t, var_t) in zip(statistics, bn_target))
            prior = p.tv * total_variation(x).mean(1) + p.l2 * ((x - 0.5) ** 2).flatten(1).mean(1)
            consistency = ((x - centre) ** 2).flatten(1).mean(1)
            return p.gradient * distance + prior + p.bn * bn + group * consistency, bn

        def summed(x: torch.Tensor, centre: torch.Tensor, group: float) -> tuple[torch.Tensor, torch.Tensor]:
            losses, _ = job_losses(x, centre, group)
            return losses.sum(), losses

        def group_mean(x: torch.Tensor) -> torch.Tensor:
            """Each job's mean over the restarts of its upload (J, B, C, H, W)."""
            return x.reshape(uploads, restarts, *x.shape[1:]).mean(1).repeat_interleave(restarts, dim=0)

        x = torch.stack([
            torch.rand((batch, *first.spec.shape), generator=torch.Generator().manual_seed(job_seed(seed, obs, r)))
            for obs in observations for r in range(restarts)
        ]).to(device)
        optimizer = torch.optim.Adam([x.requires_grad_()], lr=p.lr)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=p.iterations)
        step = grad(summed, has_aux=True)
        group_from = int(p.group_start * p.iterations)
        try:
            for iteration in range(p.iterations):
                current = x.detach()
                group = p.group if iteration >= group_from else 0.0
                x.grad, _ = step(current, group_mean(current), group)
                optimizer.step()
                scheduler.step()
                with torch.no_grad():
                    x.clamp_(0, 1)
            with torch.no_grad():
                final, bn = job_losses(x.detach(), x.detach(), 0.0)
        finally:
            recorder.remove()
        final, bn = final.reshape(uploads, restarts), bn.reshape(uploads, restarts)
        best = final.argmin(1)
        seconds = time.perf_counter() - start
        results = []
        for i, lab in enumerate(labels):
            images = x.detach()[i * restarts + int(best[i])].cpu()
            stats: dict[str, Any] = {
                "loss": float(final[i, best[i]]),
                "restart_losses": [float(v) for v in final[i]],
                "bn_distance": float(bn[i, best[i]]),
                "iterations": p.iterations,
                "restarts": restarts,
                "batched_jobs": uploads * restarts,
                "seconds": seconds / uploads,
                "labels_inferred": inferred[i],
            }
            results.append(Reconstruction(images, lab.cpu(), stats))
        return results


@register_attack("gradinversion", params=GradInversionParams, traits=class_traits(GradInversion))
def build_gradinversion(params: GradInversionParams) -> GradInversion:
    """GradInversion (Yin et al. 2021): L2 gradient matching + image, BatchNorm and group priors, Adam, restarts."""
    return GradInversion(params)
