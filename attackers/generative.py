"""A generative-prior attack in the spirit of GGL (Li et al., "Auditing Privacy Defenses in Federated Learning
via Generative Gradient Leakage", CVPR 2022), on FedSGD gradients.

Threat model: the attacker holds public data like the clients' (not theirs)
and trained a generator on it (``fedguard train-generator``). It then searches
the generator's latent space instead of pixel space: minimize
``distance(grad(G(z)), g) + kl * KL(z)`` over latents ``z`` (B, latent_dim)
per restart, where ``KL(z)`` is GGL's regularizer: the KL divergence from
N(0, 1) of a normal with the mean and variance of each latent's entries,
averaged over the batch; it keeps ``z`` where the generator was trained. GGL
searches with gradient-free CMA-ES or Bayesian optimization; here the search
is Adam on ``z``, with the learning rate divided by 10 at 3/8, 5/8 and 7/8 of
the iterations, since the whole pipeline is differentiable. Labels come from
the last layer's gradient unless the threat model grants them.

All restarts of all observations given together run as one tensor program,
as in ``attackers.inverting_gradients``: one decoder call on every latent,
``torch.func.vmap`` over jobs of the parameter gradient, one
``torch.func.grad`` w.r.t. every latent. Jobs do not interact; nothing in
the loop synchronizes with the host.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.func import functional_call, grad, vmap

from attackers.base import AttackTraits, Reconstruction, check_search_params, register_attack
from attackers.inverting_gradients import target_gradient
from attackers.jobs import JobBatch, job_seed, job_targets, resolve_device
from fedguard.generators.store import load_generator, missing_generator
from fedguard.observation import Observation
from fedguard.registry import RequiredFile
from fedguard.training import loss_fn

DISTANCES = ("cosine", "l2")
NO_GENERATOR = ("attack 'ggl' needs a generator: set attack.ggl.generator to a file made by "
                "`fedguard train-generator --data <dataset>` (by default generators/<dataset>.npz)")


@dataclass(frozen=True)
class GenerativeParams:
    """``generator``: a ``.npz`` from ``fedguard train-generator`` (required); iterations, restarts, Adam step on
    the latents, device ('auto', 'cpu', 'cuda'); ``distance``: 'cosine' (1 - cosine similarity) or 'l2' (squared
    Euclidean) between gradients; ``kl``: weight of the latent prior."""

    generator: str = ""
    iterations: int = 500
    restarts: int = 4
    lr: float = 0.1
    device: str = "auto"
    distance: str = "cosine"
    kl: float = 0.01

    def __post_init__(self) -> None:
        check_search_params(self.iterations, self.restarts, self.lr, self.device)
        if self.distance not in DISTANCES:
            raise ValueError(f"distance {self.distance!r}: choose one of {', '.join(DISTANCES)}")
        if self.kl < 0:
            raise ValueError(f"kl must be >= 0, got {self.kl}")


def latent_kl(z: torch.Tensor) -> torch.Tensor:
    """GGL's latent prior: KL(N(m, v) || N(0, 1)) with m, v the mean and variance of each latent's entries,
    averaged over the batch: (..., B, latent_dim) -> (...)."""
    var = z.var(-1, unbiased=False)
    return (0.5 * (var + z.mean(-1) ** 2 - 1 - torch.log(var + 1e-10))).mean(-1)


def gradient_distance(g: list[torch.Tensor], target: list[torch.Tensor], distance: str) -> torch.Tensor:
    """Per-job distance between gradients (J, ...) per parameter -> (J,): 'cosine' or 'l2'."""
    if distance == "l2":
        return sum(((a - b).flatten(1) ** 2).sum(1) for a, b in zip(g, target))
    dot = sum((a.flatten(1) * b.flatten(1)).sum(1) for a, b in zip(g, target))
    norm_g = torch.sqrt(sum((a.flatten(1) ** 2).sum(1) for a in g))
    norm_t = torch.sqrt(sum((b.flatten(1) ** 2).sum(1) for b in target))
    return 1 - dot / (norm_g * norm_t + 1e-12)


class GenerativeAttack:
    """Latent search of a trained generator for images whose gradient matches, batched over restarts and uploads."""

    needs: frozenset[str] = frozenset()
    uploads: frozenset[str] = frozenset({"gradient"})
    manipulation = "none"

    def __init__(self, params: GenerativeParams) -> None:
        if not params.generator:
            raise ValueError(NO_GENERATOR)
        self.params = params
        self.generator = load_generator(Path(params.generator))

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
        decoder = self.generator.decoder
        if decoder.spec.shape != first.spec.shape:
            raise ValueError(
                f"the generator {self.params.generator} makes images of shape {decoder.spec.shape}, but the uploads "
                f"come from images of shape {first.spec.shape}; train one on similar data with "
                f"`fedguard train-generator --data <dataset>`"
            )
        device = resolve_device(self.params.device)
        start = time.perf_counter()
        restarts = self.params.restarts
        jobs_of = JobBatch.of(observations, restarts, device)
        model, names, params = jobs_of.model, jobs_of.names, jobs_of.params
        matched = job_targets(jobs_of, observations, [target_gradient(o, device) for o in observations], labels)
        batch, inferred, labels = matched.batch, matched.inferred, matched.labels
        target, y = matched.target, matched.y
        jobs = len(observations) * restarts
        decoder = decoder.to(device)

        def param_grad(p: dict[str, torch.Tensor], x: torch.Tensor, yy: torch.Tensor) -> dict[str, torch.Tensor]:
            return grad(lambda q: loss_fn(functional_call(model, q, (x,)), yy))(p)

        def images(z: torch.Tensor) -> torch.Tensor:
            return decoder(z.flatten(0, 1)).reshape(jobs, batch, *first.spec.shape)

        def job_losses(z: torch.Tensor) -> torch.Tensor:
            g = vmap(param_grad)(params, images(z), y)
            distance = gradient_distance([g[n] for n in names], target, self.params.distance)
            return distance + self.params.kl * latent_kl(z)

        def summed(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            losses = job_losses(z)
            return losses.sum(), losses

        z = torch.stack([
            torch.randn((batch, decoder.latent_dim), generator=torch.Generator().manual_seed(job_seed(seed, obs, r)))
            for obs in observations for r in range(restarts)
        ]).to(device)
        optimizer = torch.optim.Adam([z.requires_grad_()], lr=self.params.lr)
        milestones = [int(self.params.iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)]
        scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
        step = grad(summed, has_aux=True)
        for _ in range(self.params.iterations):
            z.grad, _ = step(z.detach())
            optimizer.step()
            scheduler.step()
        with torch.no_grad():
            final = job_losses(z.detach()).reshape(len(observations), restarts)
            best = final.argmin(1)
            found = images(z.detach())
        seconds = time.perf_counter() - start
        results = []
        for i, (obs, lab) in enumerate(zip(observations, labels)):
            stats: dict[str, Any] = {
                "loss": float(final[i, best[i]]),
                "restart_losses": [float(v) for v in final[i]],
                "iterations": self.params.iterations,
                "restarts": restarts,
                "batched_jobs": jobs,
                "seconds": seconds / len(observations),
                "labels_inferred": inferred[i],
            }
            results.append(Reconstruction(found[i * restarts + int(best[i])].cpu(), lab.cpu(), stats))
        return results


def generative_traits(params: GenerativeParams) -> AttackTraits:
    """The class's traits and the generator file it loads."""
    generator = RequiredFile("generator", params.generator, NO_GENERATOR, missing_generator(params.generator))
    return AttackTraits.of(GenerativeAttack, files=(generator,))


@register_attack("ggl", params=GenerativeParams, traits=generative_traits)
def build_generative(params: GenerativeParams) -> GenerativeAttack:
    """Generative gradient leakage (after Li et al. 2022): latent search of a generator trained on public data."""
    return GenerativeAttack(params)
