"""Optimizers of the attack engine, all batched over jobs on dimension 0 and free of host syncs per step.

- ``signed-adam``: Adam on the sign of the gradient (Inverting Gradients);
- ``adam``: Adam on the gradient (GradInversion, GGL);
  both with a ``step`` schedule (learning rate / 10 at 3/8, 5/8 and 7/8 of the iterations), ``cosine`` decay
  to 0, or ``none``, and the space's box after each step;
- ``lbfgs``: L-BFGS with per-job history (two-loop recursion with per-job inner products) and a line search
  over fixed fractions of the step, the best kept per job. A job none of whose trial steps lowers its loss
  forgets its curvature and shrinks its own step tenfold, so a first step that overshoots never freezes a
  restart; a job that takes the full step doubles it back towards ``lr``. A job whose point turns non-finite
  (checked every ``NAN_CHECK`` iterations, the one host sync) restarts from a fresh random point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.func import grad

Losses = Callable[[torch.Tensor, float], torch.Tensor]
"""``(z (J, ...), progress in [0, 1]) -> (J,)`` losses of every job."""

SCHEDULES = ("step", "cosine", "none")
OPTIMIZERS = ("signed-adam", "adam", "lbfgs")
STEP_SCALES = (1.0, 0.3, 0.1, 0.03, 0.0)
NAN_CHECK = 25


@dataclass(frozen=True)
class OptimizerSpec:
    """``kind`` (one of ``OPTIMIZERS``), step ``lr``, ``schedule`` (Adam kinds), L-BFGS ``history``, and
    whether each step is followed by the space's ``box``."""

    kind: str = "signed-adam"
    lr: float = 0.1
    schedule: str = "step"
    history: int = 10
    box: bool = True

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.kind!r}: choose one of {', '.join(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.history < 1:
            raise ValueError(f"history must be >= 1, got {self.history}")


def _scheduler(optimizer: torch.optim.Optimizer, schedule: str, iterations: int) -> torch.optim.lr_scheduler.LRScheduler:
    if schedule == "step":
        milestones = [int(iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)]
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
    if schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=iterations)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def adam(z: torch.Tensor, losses: Losses, iterations: int, spec: OptimizerSpec,
         project: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """``iterations`` Adam steps on every job's ``z`` (signed gradient for 'signed-adam'); returns the end point."""
    z = z.detach().clone().requires_grad_()
    optimizer = torch.optim.Adam([z], lr=spec.lr)
    scheduler = _scheduler(optimizer, spec.schedule, iterations)
    step = grad(lambda point, progress: losses(point, progress).sum())
    signed = spec.kind == "signed-adam"
    for iteration in range(iterations):
        dz = step(z.detach(), iteration / iterations)
        z.grad = dz.sign() if signed else dz
        optimizer.step()
        scheduler.step()
        if spec.box:
            with torch.no_grad():
                project(z)
    return z.detach()


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-job inner product of (J, ...) tensors -> (J,)."""
    return (a.flatten(1) * b.flatten(1)).sum(1)


def _expand(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.reshape(-1, *([1] * (like.dim() - 1)))


class BatchedLBFGS:
    """L-BFGS directions for J independent problems stacked on dimension 0 (no line search of its own)."""

    def __init__(self, history: int) -> None:
        self.history = history
        self.s: list[torch.Tensor] = []
        self.y: list[torch.Tensor] = []
        self.previous: tuple[torch.Tensor, torch.Tensor] | None = None

    def forget(self, jobs: torch.Tensor) -> None:
        """Forget the curvature of the jobs where ``jobs`` (J,) is True."""
        keep = ~jobs
        self.s = [s * _expand(keep, s) for s in self.s]
        self.y = [y * _expand(keep, y) for y in self.y]
        if self.previous is not None:
            x, g = self.previous
            self.previous = (torch.where(_expand(keep, x), x, torch.nan), g)

    def direction(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """The quasi-Newton step to subtract from ``x`` given its gradient ``g`` (both (J, ...))."""
        if self.previous is not None:
            s, y = x - self.previous[0], g - self.previous[1]
            valid = _dot(s, y) > 1e-10  # NaN (a forgotten job) compares False
            self.s.append(torch.where(_expand(valid, s), s, 0.0))
            self.y.append(torch.where(_expand(valid, y), y, 0.0))
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
            q = q * _expand(torch.where(sy > 1e-10, sy / yy.clamp_min(1e-20), torch.ones_like(sy)), q)
        for (s, y), (alpha, rho) in zip(zip(self.s, self.y), reversed(alphas)):
            q = q + _expand(alpha - rho * _dot(y, q), q) * s
        return q


def lbfgs(z: torch.Tensor, losses: Losses, iterations: int, spec: OptimizerSpec,
          project: Callable[[torch.Tensor], None], fresh: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``iterations`` L-BFGS steps with the batched line search; ``fresh(jobs)`` gives new starting points for
    the jobs (J,) bool that turned non-finite. Returns the end point and each job's count of such restarts."""
    jobs = z.shape[0]
    device = z.device
    gradient_of = grad(lambda point: losses(point, 1.0).sum())
    optimizer = BatchedLBFGS(spec.history)
    scales = torch.tensor(STEP_SCALES, device=device).reshape(-1, 1, *([1] * (z.dim() - 1)))
    step_size = torch.full((jobs,), spec.lr, device=device)
    resets = torch.zeros(jobs, dtype=torch.long, device=device)
    rows = torch.arange(jobs, device=device)
    for iteration in range(iterations):
        direction = optimizer.direction(z, gradient_of(z)) * _expand(step_size, z)
        trials = z.unsqueeze(0) - scales * direction.unsqueeze(0)
        trial_losses = torch.stack([losses(trial, 1.0) for trial in trials])
        trial_losses = torch.where(torch.isfinite(trial_losses), trial_losses, torch.inf)
        best = trial_losses.argmin(0)
        stuck = trial_losses[best, rows] >= trial_losses[-1]  # no trial below the point itself (scale 0)
        z = trials[best, rows]
        if spec.box:
            project(z)
        optimizer.forget(stuck)
        step_size = torch.where(stuck, step_size * 0.1, torch.where(best == 0, (step_size * 2).clamp_max(spec.lr),
                                                                    step_size))
        if (iteration + 1) % NAN_CHECK == 0:
            bad = ~torch.isfinite(z.flatten(1)).all(1) | ~torch.isfinite(losses(z, 1.0))
            if bool(bad.any()):
                resets += bad.long()
                z = torch.where(_expand(bad, z), fresh(bad).to(device), z)
                optimizer.forget(bad)
                step_size = torch.where(bad, spec.lr, step_size)
    return z, resets
