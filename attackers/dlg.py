"""Deep Leakage from Gradients (Zhu et al., NeurIPS 2019) and iDLG (Zhao et al., 2020).

DLG minimizes the squared L2 distance between the gradient of dummy data and
the captured gradient, optimizing the images and soft labels (logits whose
softmax is the target distribution) together with L-BFGS. iDLG infers the
labels analytically from the last layer (``attackers.labels``) and optimizes
the images only.

Restarts and uploads of one shape run together: each job keeps its own
L-BFGS history (two-loop recursion with per-job inner products), so jobs do
not interact. A job whose loss turns non-finite, a known failure of DLG, is
restarted from a fresh random point; restarts that end far from the gradient
are what the ``restarts`` parameter is for (DLG either converges or stays
noise).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.func import functional_call, grad, vmap

from attackers.base import Reconstruction, check_search_params, class_traits, images_per_upload, register_attack
from attackers.inverting_gradients import target_gradient
from attackers.jobs import JobBatch, job_seed, resolve_device
from attackers.labels import declared_labels, upload_labels_inferred
from fedguard.observation import Observation


STEP_SCALES = (1.0, 0.3, 0.1, 0.03, 0.0)


@dataclass(frozen=True)
class DLGParams:
    """Iterations, restarts, L-BFGS step and history length, device ('auto', 'cpu', 'cuda')."""

    iterations: int = 300
    restarts: int = 4
    lr: float = 1.0
    history: int = 10
    device: str = "auto"

    def __post_init__(self) -> None:
        check_search_params(self.iterations, self.restarts, self.lr, self.device)
        if self.history < 1:
            raise ValueError(f"history must be >= 1, got {self.history}")


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-job inner product of (J, ...) tensors -> (J,)."""
    return (a.flatten(1) * b.flatten(1)).sum(1)


def _expand(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.reshape(-1, *([1] * (like.dim() - 1)))


class BatchedLBFGS:
    """L-BFGS without line search for J independent problems stacked on dimension 0."""

    def __init__(self, history: int, lr: float) -> None:
        self.history, self.lr = history, lr
        self.s: list[torch.Tensor] = []
        self.y: list[torch.Tensor] = []
        self.previous: tuple[torch.Tensor, torch.Tensor] | None = None

    def reset(self, jobs: torch.Tensor) -> None:
        """Forget the curvature of the jobs where ``jobs`` (J,) is True."""
        keep = _expand(~jobs, self.s[0]) if self.s else None
        if keep is not None:
            self.s = [s * keep for s in self.s]
            self.y = [y * keep for y in self.y]

    def direction(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The step to subtract from ``x`` given its gradient ``g`` (both (J, ...))."""
        if self.previous is not None:
            s, y = x - self.previous[0], g - self.previous[1]
            valid = _dot(s, y) > 1e-10
            self.s.append(s * _expand(valid, s))
            self.y.append(y * _expand(valid, y))
            self.s, self.y = self.s[-self.history :], self.y[-self.history :]
        self.previous = (x.clone(), g.clone())
        q, alphas = g.clone(), []
        for s, y in zip(reversed(self.s), reversed(self.y)):
            sy = _dot(s, y)
            rho = torch.where(sy > 1e-10, 1.0 / sy.clamp_min(1e-10), torch.zeros_like(sy))
            alpha = rho * _dot(s, q)
            q = q - _expand(alpha, q) * y
            alphas.append((alpha, rho))
        if self.s:
            sy, yy = _dot(self.s[-1], self.y[-1]), _dot(self.y[-1], self.y[-1])
            gamma = torch.where(sy > 1e-10, sy / yy.clamp_min(1e-20), torch.ones_like(sy))
            q = q * _expand(gamma, q)
        for (s, y), (alpha, rho) in zip(zip(self.s, self.y), reversed(alphas)):
            beta = rho * _dot(y, q)
            q = q + _expand(alpha - beta, q) * s
        return self.lr * q


class DeepLeakage:
    """DLG (joint soft labels) or iDLG (analytic labels), batched over restarts and uploads."""

    needs: frozenset[str] = frozenset()
    uploads: frozenset[str] = frozenset({"gradient"})
    manipulation = "none"

    def __init__(self, params: DLGParams, infer: bool) -> None:
        self.params = params
        self.infer = infer

    def reconstruct(self, obs: Observation) -> Reconstruction:
        """Reconstruct the batch behind one upload."""
        return self.reconstruct_many([obs])[0]

    def reconstruct_many(self, observations: list[Observation], seed: int = 0) -> list[Reconstruction]:
        """Reconstruct several uploads of one architecture and batch size together."""
        if not observations:
            return []
        first = observations[0]
        device = resolve_device(self.params.device)
        start = time.perf_counter()
        batch, classes, restarts = images_per_upload(first), first.spec.num_classes, self.params.restarts
        jobs_of = JobBatch.of(observations, restarts, device)
        model, names, params, stack = jobs_of.model, jobs_of.names, jobs_of.params, jobs_of.per_job
        targets = [target_gradient(o, device) for o in observations]
        target = [stack([t[i] for t in targets]) for i in range(len(names))]
        given = [declared_labels(o.declared) for o in observations]
        if self.infer or all(lab is not None for lab in given):
            known = [(upload_labels_inferred(o, t, batch) if lab is None else lab).to(device)
                     for o, lab, t in zip(observations, given, targets)]
        else:
            known = None
        fixed = stack(known) if known is not None else None
        pixels = batch * first.spec.channels * first.spec.height * first.spec.width

        def job_loss(z: torch.Tensor, p: dict[str, torch.Tensor], t: list[torch.Tensor], y: torch.Tensor | None):
            images = z[:pixels].reshape(batch, *first.spec.shape)

            def loss_of(q: dict[str, torch.Tensor]) -> torch.Tensor:
                logits = functional_call(model, q, (images,))
                if y is not None:
                    return torch.nn.functional.cross_entropy(logits, y)
                soft = torch.softmax(z[pixels:].reshape(batch, classes), dim=1)
                return -(soft * torch.log_softmax(logits, dim=1)).sum(1).mean()

            g = grad(loss_of)(p)
            return sum(((g[n] - tn) ** 2).sum() for n, tn in zip(names, t))

        losses = vmap(job_loss, in_dims=(0, 0, 0, None if fixed is None else 0))
        step = vmap(grad(job_loss), in_dims=(0, 0, 0, None if fixed is None else 0))

        def fresh(job: int, attempt: int) -> torch.Tensor:
            obs = observations[job // restarts]
            generator = torch.Generator().manual_seed(job_seed(seed + attempt, obs, job % restarts))
            size = pixels + (0 if known is not None else batch * classes)
            return torch.rand(size, generator=generator)

        jobs = len(observations) * restarts
        z = torch.stack([fresh(j, 0) for j in range(jobs)]).to(device)
        optimizer = BatchedLBFGS(self.params.history, self.params.lr)
        resets = torch.zeros(jobs, dtype=torch.long, device=device)
        check = 25
        scales = torch.tensor(STEP_SCALES, device=device)
        for iteration in range(self.params.iterations):
            g = step(z, params, target, fixed)
            d = optimizer.direction(z, g)
            # Line search without host syncs: the loss at every scale of the step, the best kept per job.
            trials = z.unsqueeze(0) - scales.reshape(-1, 1, 1) * d.unsqueeze(0)
            trial_losses = torch.stack([losses(trial, params, target, fixed) for trial in trials])
            trial_losses = torch.where(torch.isfinite(trial_losses), trial_losses, torch.full_like(trial_losses, float("inf")))
            z = trials[trial_losses.argmin(0), torch.arange(jobs, device=device)]
            if (iteration + 1) % check == 0:
                bad = ~torch.isfinite(z).all(1) | ~torch.isfinite(losses(z, params, target, fixed))
                if bool(bad.any()):
                    for job in torch.nonzero(bad).flatten().tolist():
                        resets[job] += 1
                        z[job] = fresh(job, int(resets[job])).to(device)
                    optimizer.reset(bad)
                    optimizer.previous = None
        final = losses(z, params, target, fixed)
        final = torch.where(torch.isfinite(final), final, torch.full_like(final, float("inf")))
        final = final.reshape(len(observations), restarts)
        best = final.argmin(1)
        seconds = time.perf_counter() - start
        results = []
        for i in range(len(observations)):
            job = i * restarts + int(best[i])
            images = torch.nan_to_num(z[job, :pixels], nan=0.5).reshape(batch, *first.spec.shape).clamp(0, 1).cpu()
            if known is not None:
                labels = known[i].cpu()
            else:
                labels = z[job, pixels:].reshape(batch, classes).argmax(1).cpu()
            stats: dict[str, Any] = {
                "loss": float(final[i, best[i]]),
                "restart_losses": [float(v) for v in final[i]],
                "iterations": self.params.iterations,
                "restarts": restarts,
                "nan_restarts": int(resets[i * restarts : (i + 1) * restarts].sum()),
                "seconds": seconds / len(observations),
            }
            results.append(Reconstruction(images, labels, stats))
        return results


@register_attack("dlg", params=DLGParams, traits=class_traits(DeepLeakage))
def build_dlg(params: DLGParams) -> DeepLeakage:
    """DLG (Zhu et al. 2019): L2 gradient matching, L-BFGS, images and soft labels optimized jointly."""
    return DeepLeakage(params, infer=False)


@register_attack("idlg", params=DLGParams, traits=class_traits(DeepLeakage))
def build_idlg(params: DLGParams) -> DeepLeakage:
    """iDLG (Zhao et al. 2020): DLG with the labels inferred from the last layer's gradient."""
    return DeepLeakage(params, infer=True)
