"""Inverting Gradients (Geiping et al., NeurIPS 2020), on FedSGD gradients and FedAvg weight updates.

Find images whose gradient points the same way as the captured one:
minimize ``1 - cos(grad(x), g) + tv * TV(x)`` over dummy images ``x`` with
Adam on the sign of the gradient, boxed to [0, 1], with the learning rate
divided by 10 at 3/8, 5/8 and 7/8 of the iterations. Labels come from the
last layer's gradient (``attackers.labels``) unless the threat model grants
them. On FedAvg weights the attacker replays the client's declared local
steps (learning rate, epochs, batch size) on the dummy data and matches
``global - uploaded`` weights instead of the gradient.

Adaptive variants: ``skip`` leaves the layers a defense is known to alter
out of the distance (the fair test of Soteria); ``eot`` > 0 is expectation
over transformation against a randomized defense the server knows (threat
``defense``): each iteration passes the dummy update through ``eot`` fresh
draws of the defense (``simulate``) and averages the distances.

All restarts of all observations given together run as one tensor program:
``torch.func.vmap`` over jobs of the parameter gradient of each job's dummy
batch, and one ``torch.func.grad`` of the summed loss w.r.t. every dummy
image at once. Jobs do not interact, so the result equals running them one
after another. Losses stay on the device until the end; nothing in the loop
synchronizes with the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.func import functional_call, grad, vmap

from attackers.base import AttackTraits, Reconstruction, check_search_params, register_attack
from attackers.jobs import JobBatch, job_seed, job_targets, resolve_device
from fedguard.defenses.base import SimulatedDefense
from fedguard.observation import Observation
from fedguard.training import loss_fn


@dataclass(frozen=True)
class InvertingGradientsParams:
    """Iterations, restarts, Adam step on [0, 1] pixels, total-variation weight, device ('auto', 'cpu', 'cuda'),
    ``skip``: comma-separated parameter-name prefixes left out of the distance (the layers a defense alters),
    ``eot``: draws of the known defense averaged per iteration (0: off; needs threat.defense)."""

    iterations: int = 2000
    restarts: int = 2
    lr: float = 0.025
    tv: float = 1e-4
    device: str = "auto"
    skip: str = ""
    eot: int = 0

    def __post_init__(self) -> None:
        check_search_params(self.iterations, self.restarts, self.lr, self.device)
        if self.tv < 0:
            raise ValueError(f"tv must be >= 0, got {self.tv}")
        if self.eot < 0:
            raise ValueError(f"eot must be >= 0 (0: off), got {self.eot}")

    def skipped(self, name: str) -> bool:
        """True when parameter ``name`` is left out of the gradient distance."""
        return any(name.startswith(prefix.strip()) for prefix in self.skip.split(",") if prefix.strip())


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of neighbouring pixels of images (..., C, H, W) -> (...)."""
    dx = (x[..., :, :, 1:] - x[..., :, :, :-1]).abs().mean((-3, -2, -1))
    dy = (x[..., :, 1:, :] - x[..., :, :-1, :]).abs().mean((-3, -2, -1))
    return dx + dy


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


@dataclass(frozen=True)
class LocalSchedule:
    """The local training a FedAvg client declared: SGD step ``lr``, ``epochs`` over its examples in
    minibatches of ``batch_size``."""

    lr: float
    epochs: int
    batch_size: int

    @classmethod
    def of(cls, obs: Observation) -> "LocalSchedule":
        try:
            return cls(float(obs.declared["lr"]), int(obs.declared["local-epochs"]), int(obs.declared["batch-size"]))
        except KeyError as missing:
            raise ValueError(f"a weights upload without the declared local hyper-parameter {missing}") from None


def local_update_fn(param_grad: Any, schedule: LocalSchedule, examples: int) -> Any:
    """``(params, x, y) -> params - params_after_local_SGD``: the client's FedAvg steps replayed on dummy data.

    The client's shuffling is unknown; minibatches are taken in order (as Geiping et al. do)."""

    def local_update(p: dict[str, torch.Tensor], x: torch.Tensor, yy: torch.Tensor) -> dict[str, torch.Tensor]:
        q = p
        for _ in range(schedule.epochs):
            for start in range(0, examples, schedule.batch_size):
                g = param_grad(q, x[start : start + schedule.batch_size], yy[start : start + schedule.batch_size])
                q = {n: q[n] - schedule.lr * g[n] for n in q}
        return {n: p[n] - q[n] for n in p}

    return local_update


class InvertingGradients:
    """Cosine-similarity gradient inversion with TV prior, batched over restarts and observations."""

    needs_by_upload = {"weights": frozenset({"hyperparameters"})}
    uploads: frozenset[str] = frozenset({"gradient", "weights"})
    manipulation = "none"

    def __init__(self, params: InvertingGradientsParams) -> None:
        self.params = params
        self.needs: frozenset[str] = inverting_gradients_traits(params).needs
        self.defense: SimulatedDefense | None = None

    def know_defense(self, defense: Any) -> None:
        """The clients' defense, for EOT; it must be able to ``simulate`` itself on a batch of updates."""
        if not callable(getattr(defense, "simulate", None)):
            raise ValueError(f"EOT needs a defense that can be simulated; {type(defense).__name__} cannot "
                             f"(set attack.ig.eot = 0)")
        self.defense = defense

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
        first = observations[0]
        device = resolve_device(self.params.device)
        start = time.perf_counter()
        restarts = self.params.restarts
        jobs_of = JobBatch.of(observations, restarts, device)
        model, names, params = jobs_of.model, jobs_of.names, jobs_of.params
        matched = job_targets(jobs_of, observations, [target_update(o, device) for o in observations], labels)
        batch, inferred, labels = matched.batch, matched.inferred, matched.labels
        target, y = matched.target, matched.y
        jobs = len(observations) * restarts
        compared = [n for n in names if not self.params.skipped(n)]
        if not compared:
            raise ValueError(f"skip = {self.params.skip!r} leaves no parameter to compare; parameters: {', '.join(names)}")
        target = [t for n, t in zip(names, target) if not self.params.skipped(n)]
        target_norm = torch.sqrt(sum((t.flatten(1) ** 2).sum(1) for t in target))

        def param_grad(p: dict[str, torch.Tensor], x: torch.Tensor, yy: torch.Tensor) -> dict[str, torch.Tensor]:
            return grad(lambda q: loss_fn(functional_call(model, q, (x,)), yy))(p)

        update = param_grad
        if first.kind == "weights":
            update = local_update_fn(param_grad, LocalSchedule.of(first), batch)

        def distance(g: dict[str, torch.Tensor]) -> torch.Tensor:
            dot = sum((g[n].flatten(1) * t.flatten(1)).sum(1) for n, t in zip(compared, target))
            norm = torch.sqrt(sum((g[n].flatten(1) ** 2).sum(1) for n in compared))
            return 1 - dot / (norm * target_norm + 1e-12)

        eot = self._eot_draws(device, seed)

        def job_losses(x: torch.Tensor) -> torch.Tensor:
            g = vmap(update)(params, x, y)
            return eot(g, distance) + self.params.tv * total_variation(x).mean(1)

        def summed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            losses = job_losses(x)
            return losses.sum(), losses

        x = torch.stack([
            torch.rand((batch, *first.spec.shape), generator=torch.Generator().manual_seed(job_seed(seed, obs, r)))
            for obs in observations for r in range(restarts)
        ]).to(device)
        optimizer = torch.optim.Adam([x.requires_grad_()], lr=self.params.lr)
        milestones = [int(self.params.iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)]
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
        step = grad(summed, has_aux=True)
        for _ in range(self.params.iterations):
            dx, _ = step(x.detach())
            x.grad = dx.sign()
            optimizer.step()
            scheduler.step()
            with torch.no_grad():
                x.clamp_(0, 1)
        with torch.no_grad():
            final = job_losses(x.detach()).reshape(len(observations), restarts)
        best = final.argmin(1)
        seconds = time.perf_counter() - start
        results = []
        for i, (obs, lab) in enumerate(zip(observations, labels)):
            images = x.detach()[i * restarts + int(best[i])].cpu()
            stats: dict[str, Any] = {
                "loss": float(final[i, best[i]]),
                "restart_losses": [float(v) for v in final[i]],
                "iterations": self.params.iterations,
                "restarts": restarts,
                "batched_jobs": jobs,
                "seconds": seconds / len(observations),
                "labels_inferred": inferred[i],
            }
            results.append(Reconstruction(images, lab.cpu(), stats))
        return results


    def _eot_draws(self, device: torch.device, seed: int) -> Any:
        """``(g, distance) -> (J,)``: the distance of ``g`` itself, or its mean over ``eot`` draws of the defense."""
        if not self.params.eot:
            return lambda g, distance: distance(g)
        if self.defense is None:
            raise ValueError("attack.ig.eot > 0 needs the clients' defense (threat.defense = true)")
        generator = torch.Generator(device=device).manual_seed(seed)
        defense, draws = self.defense, self.params.eot

        def expected(g: dict[str, torch.Tensor], distance: Any) -> torch.Tensor:
            names = list(g)
            total = 0
            for _ in range(draws):
                total = total + distance(dict(zip(names, defense.simulate([g[n] for n in names], generator))))
            return total / draws

        return expected


def inverting_gradients_traits(params: InvertingGradientsParams) -> AttackTraits:
    """The class's traits; with ``eot`` > 0 it also needs the clients' defense, and one that can simulate itself."""
    return AttackTraits.of(InvertingGradients, needs=frozenset({"defense"}) if params.eot else frozenset(),
                           simulates_defense=params.eot > 0)


@register_attack("ig", params=InvertingGradientsParams, traits=inverting_gradients_traits)
def build_inverting_gradients(params: InvertingGradientsParams) -> InvertingGradients:
    """Inverting Gradients (Geiping et al. 2020): cosine distance + TV, signed Adam, restarts."""
    return InvertingGradients(params)
