"""Optimizers of the attack engine, all batched over jobs on dimension 0 and free of host syncs per step.

- ``signed-adam``: Adam on the sign of the gradient (Inverting Gradients);
- ``adam``: Adam on the gradient (GradInversion, GGL);
  both torch's fused Adam where the device has it, with a ``step`` schedule (learning rate / 10 at 3/8, 5/8
  and 7/8 of the iterations), ``cosine`` decay to 0, or ``none``, and the space's box after each step;
- ``lbfgs``: L-BFGS with per-job history (two-loop recursion with per-job inner products); ``line_search``:
  ``none`` (torch's default, the DLG paper's optimizer): a fixed step ``lr`` (the first scaled by
  ``min(1, 1 / |g|_1)``), a job standing still once torch's tolerances say it converged;
  ``fractions``: trial steps at fixed fractions, the best kept per job. A job none of whose trial steps lowers
  its loss forgets its curvature and shrinks its own step tenfold, so a first step that overshoots never
  freezes a restart; a job that takes the full step doubles it back towards ``lr``.
  A job whose point turns non-finite (checked every ``NAN_CHECK`` iterations, the one host sync) restarts from
  a fresh random point.

Each optimizer takes ``losses_at(progress)``, the jobs' loss function at a fraction of the iterations (the same
function object while the active terms stay the same), and a ``Compiler`` (``attackers.engine.compiled``) that
compiles the gradient and trial evaluations built from it, once per distinct function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.func import grad, grad_and_value, vmap

Losses = Callable[[torch.Tensor], torch.Tensor]
"""``z (J, ...) -> (J,)`` losses of every job."""
LossesAt = Callable[[float], Losses]
"""``progress in [0, 1] -> Losses``: the objective at a fraction of the iterations."""
Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]
"""Compiles a function (``attackers.engine.compiled.Compiler``) or returns it as it is."""


def _eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


SCHEDULES = ("step", "cosine", "none")
OPTIMIZERS = ("signed-adam", "adam", "lbfgs")
LINE_SEARCHES = ("none", "fractions")
STEP_SCALES = (1.0, 0.3, 0.1, 0.03)
NAN_CHECK = 25
FUSED_ADAM_DEVICES = ("cpu", "cuda")  # one kernel per step instead of ~10 (CPU: 52 -> 29 us for 8 32x32 jobs)
TOLERANCE_GRAD, TOLERANCE_CHANGE = 1e-7, 1e-9  # torch.optim.LBFGS's defaults


@dataclass(frozen=True)
class OptimizerSpec:
    """``kind`` (one of ``OPTIMIZERS``), step ``lr``, ``schedule`` (Adam kinds), L-BFGS ``history`` and
    ``line_search`` (one of ``LINE_SEARCHES``), and whether each step is followed by the space's ``box``."""

    kind: str = "signed-adam"
    lr: float = 0.1
    schedule: str = "step"
    history: int = 10
    line_search: str = "fractions"
    box: bool = True

    def __post_init__(self) -> None:
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.kind!r}: choose one of {', '.join(OPTIMIZERS)}")
        check_schedule(self.schedule)
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.history < 1:
            raise ValueError(f"history must be >= 1, got {self.history}")
        if self.line_search not in LINE_SEARCHES:
            raise ValueError(f"line_search {self.line_search!r}: choose one of {', '.join(LINE_SEARCHES)}")


def check_schedule(schedule: str) -> None:
    """Raises ``ValueError`` naming ``schedule`` unless it is one of ``SCHEDULES``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")


def scheduler_of(
    optimizer: torch.optim.Optimizer, schedule: str, iterations: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """The learning-rate ``schedule`` over ``iterations`` steps: ``step`` divides it by 10 at 3/8, 5/8
    and 7/8, ``cosine`` decays it along a half cosine to 0, ``none`` keeps it."""
    if schedule == "step":
        milestones = [int(iterations * f) for f in (3 / 8, 5 / 8, 7 / 8)]
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
    if schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=iterations)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def adam(
    z: torch.Tensor,
    losses_at: LossesAt,
    iterations: int,
    spec: OptimizerSpec,
    project: Callable[[torch.Tensor], None],
    compiler: Wrap = _eager,
) -> torch.Tensor:
    """``iterations`` Adam steps on every job's ``z`` (signed gradient for 'signed-adam'); returns the end point."""
    z = z.detach().clone().requires_grad_()
    optimizer = torch.optim.Adam([z], lr=spec.lr, fused=z.device.type in FUSED_ADAM_DEVICES)
    scheduler = scheduler_of(optimizer, spec.schedule, iterations)
    signed = spec.kind == "signed-adam"
    steps: dict[Losses, Callable[..., Any]] = {}

    def step_of(losses: Losses) -> Callable[..., Any]:
        direction = grad(lambda point: losses(point).sum())
        return compiler((lambda point: direction(point).sign()) if signed else direction)

    for iteration in range(iterations):
        losses = losses_at(iteration / iterations)
        if losses not in steps:
            steps[losses] = step_of(losses)
        z.grad = steps[losses](z.detach())
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


def lbfgs(
    z: torch.Tensor,
    losses_at: LossesAt,
    iterations: int,
    spec: OptimizerSpec,
    project: Callable[[torch.Tensor], None],
    fresh: Callable[[torch.Tensor], torch.Tensor],
    compiler: Wrap = _eager,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``iterations`` L-BFGS iterations with ``spec.line_search`` on ``losses_at(1.0)``; ``fresh(jobs)`` gives
    new starting points for the jobs (J,) bool that turned non-finite. Returns the end point and each job's count
    of such restarts."""
    losses = losses_at(1.0)
    evaluate = Evaluations(compiler(grad_and_value(_total_and_each(losses), has_aux=True)), compiler(vmap(losses)))
    step = _fixed_step if spec.line_search == "none" else _fraction_search
    jobs, device = z.shape[0], z.device
    optimizer = BatchedLBFGS(spec.history)
    state = {
        "resets": torch.zeros(jobs, dtype=torch.long, device=device),
        "first": torch.ones(jobs, dtype=torch.bool, device=device),
        "step_size": torch.full((jobs,), spec.lr, device=device),
        "previous_loss": torch.full((jobs,), torch.inf, device=device),
    }
    for iteration in range(iterations):
        z = step(z, evaluate, optimizer, spec, state)
        if spec.box:
            project(z)
        if (iteration + 1) % NAN_CHECK == 0:
            bad = ~torch.isfinite(z.flatten(1)).all(1) | ~torch.isfinite(losses(z))
            if bool(bad.any()):
                state["resets"] += bad.long()
                z = torch.where(_expand(bad, z), fresh(bad).to(device), z)
                optimizer.forget(bad)
                state["step_size"] = torch.where(bad, spec.lr, state["step_size"])
                state["first"] = state["first"] | bad
                state["previous_loss"] = torch.where(bad, torch.inf, state["previous_loss"])
    return z, state["resets"]


def _total_and_each(losses: Losses) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``z -> (sum of the jobs' losses, (J,) losses detached)``, for ``grad_and_value`` with ``has_aux``."""

    def total(point: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        each = losses(point)
        return each.sum(), each.detach()

    return total


@dataclass(frozen=True)
class Evaluations:
    """What an L-BFGS iteration evaluates: ``gradient(z) -> (dz, (total, (J,) losses))`` and
    ``trials(points (T, J, ...)) -> (T, J)`` losses, each possibly compiled."""

    gradient: Callable[..., Any]
    trials: Callable[..., Any]


def _fixed_step(
    z: torch.Tensor, evaluate: Evaluations, optimizer: BatchedLBFGS, spec: OptimizerSpec, state: dict[str, torch.Tensor]
) -> torch.Tensor:
    """One iteration of ``torch.optim.LBFGS`` without line search, per job: step ``lr`` along the quasi-Newton
    direction (the first one scaled by ``min(1, 1 / |g|_1)``); a job whose gradient, descent or last change of
    loss is below torch's tolerances stands still."""
    g, (_, loss) = evaluate.gradient(z)
    direction = optimizer.direction(z, g)
    lr = torch.where(state["first"], (1.0 / g.flatten(1).abs().sum(1)).clamp_max(1.0) * spec.lr, spec.lr)
    converged = (
        (g.flatten(1).abs().amax(1) <= TOLERANCE_GRAD)
        | (_dot(g, direction) < TOLERANCE_CHANGE)
        | ((loss - state["previous_loss"]).abs() < TOLERANCE_CHANGE)
    )
    state["first"] = state["first"] & converged
    state["previous_loss"] = loss
    return z - _expand(torch.where(converged, 0.0, lr), z) * direction


def _fraction_search(
    z: torch.Tensor, evaluate: Evaluations, optimizer: BatchedLBFGS, spec: OptimizerSpec, state: dict[str, torch.Tensor]
) -> torch.Tensor:
    """One iteration with the line search over ``STEP_SCALES`` of the step (all trials in one vmapped
    evaluation), the best kept per job; a job with no trial below its loss forgets its curvature and shrinks its
    step tenfold, one taking the full step doubles it back towards ``lr``."""
    rows = torch.arange(z.shape[0], device=z.device)
    scales = torch.tensor(STEP_SCALES, device=z.device).reshape(-1, 1, *([1] * (z.dim() - 1)))
    gradient, (_, here) = evaluate.gradient(z)
    direction = optimizer.direction(z, gradient) * _expand(state["step_size"], z)
    trials = z.unsqueeze(0) - scales * direction.unsqueeze(0)
    trial_losses = torch.cat([evaluate.trials(trials), here.unsqueeze(0)])
    trial_losses = torch.where(torch.isfinite(trial_losses), trial_losses, torch.inf)
    best = trial_losses.argmin(0)
    stuck = best == len(STEP_SCALES)  # no trial below the point itself
    optimizer.forget(stuck)
    size = state["step_size"]
    state["step_size"] = torch.where(stuck, size * 0.1, torch.where(best == 0, (size * 2).clamp_max(spec.lr), size))
    return torch.cat([trials, z.unsqueeze(0)])[best, rows]
