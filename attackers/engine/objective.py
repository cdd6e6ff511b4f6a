"""Each job's loss at a point of the search space: the weighted gradient distance plus the weighted priors.

The dummy update of every job comes from one vmapped call: the parameter
gradient of its dummy batch (FedSGD) or the client's declared local SGD
replayed on it (FedAvg: ``global - after``; minibatches cut in order from one
copy of the examples as Geiping et al. do, or, the shuffle searched, epoch e's
from copy e, ``attackers.engine.spaces.EpochCopiesSpace``). BatchNorm input
statistics are recorded in the same forward pass when a ``bn`` term asks for
them; a FedAvg replay turns them into the change of the running statistics
its steps make, for a ``running-stats`` term. The
dummy update runs in the spec's ``precision`` (weights and images cast once per
evaluation); it comes back in float32 for the distance and the priors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

from attackers.engine.aware import aware_phases
from attackers.engine.local_schedule import LocalSchedule
from attackers.engine.problem import Problem
from attackers.engine.spaces import EpochCopiesSpace, JointSpace, RobustMixtureSpace
from attackers.engine.spec import PRECISIONS, SearchSpec
from attackers.engine.terms import DISTANCES, PRIORS, Statistics, Term, TermInputs

Gradients = dict[str, torch.Tensor]


class BatchNormInputs:
    """Forward hooks that record, per named BatchNorm module, the per-channel mean and variance (biased, or
    ``unbiased`` as running statistics take it) of its input during the latest forward pass (works inside
    ``torch.func`` transforms)."""

    def __init__(self, model: nn.Module, names: list[str], unbiased: bool = False) -> None:
        modules = dict(model.named_modules())
        self.names, self.correction = names, int(unbiased)
        self.seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name in names:
            modules[name].register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Callable[..., None]:
        def record(module: nn.Module, inputs: tuple[torch.Tensor, ...], _: torch.Tensor) -> None:
            h = inputs[0]
            dims = [0, *range(2, h.dim())]
            self.seen[name] = (h.mean(dims), h.var(dims, correction=self.correction))

        return record

    def start(self) -> None:
        """Record into a new dict: the hooks then mutate no object that outlives the pass."""
        self.seen = {}

    def statistics(self) -> Statistics:
        """(mean, variance) per module, (channels,) each, in ``names`` order, recorded since ``start``; the
        record is dropped, so that no tensor of a ``torch.func`` transform outlives it (``torch.compile`` cannot
        compile a program that keeps one)."""
        seen, self.seen = self.seen, {}
        return [seen[name] for name in self.names]


def batch_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of ``logits`` (B, classes) against int64 labels (B,) or label distributions (B, classes):
    the mean, or the sum weighted by ``weights`` (B,)."""
    if labels.is_floating_point():
        losses = -(labels * torch.log_softmax(logits, dim=-1)).sum(-1)
        return losses.mean() if weights is None else (weights * losses).sum()
    if weights is None:
        return torch.nn.functional.cross_entropy(logits, labels)
    return (weights * torch.nn.functional.cross_entropy(logits, labels, reduction="none")).sum()


class Objective:
    """``losses_at(progress)(z)`` (J,) to minimize and ``selection(z)`` to choose restarts by."""

    def __init__(self, spec: SearchSpec, problem: Problem, defense: Any, seed: int) -> None:
        self.spec, self.problem = spec, problem
        jobs = problem.batch_of_jobs
        model, names = jobs.model, jobs.names
        running = problem.running_momenta
        recorder = BatchNormInputs(model, problem.bn_layers, unbiased=bool(running)) if problem.bn_layers else None

        def param_grad(
            p: Gradients, x: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
        ) -> tuple[Gradients, Statistics]:
            def loss_of(q: Gradients) -> tuple[torch.Tensor, Statistics]:
                if recorder:
                    recorder.start()
                loss = batch_loss(functional_call(model, q, (x,)), labels, weights)
                return loss, recorder.statistics() if recorder else []

            return grad(loss_of, has_aux=True)(p)

        update = param_grad
        self.copies = problem.space.epochs if isinstance(problem.space, EpochCopiesSpace) else 1
        if problem.observations[0].kind == "weights":
            update = local_update_fn(
                param_grad, LocalSchedule.of(problem.observations[0]), problem.examples, self.copies, running
            )
        self.weighted = isinstance(problem.space, RobustMixtureSpace)
        self.update = vmap(update, in_dims=(None if jobs.shared else 0, 0, 0, *([0] if self.weighted else [])))
        self.dtype = PRECISIONS[spec.precision]
        self.params = {name: p.to(self.dtype) for name, p in jobs.params.items()}
        self.compared = [n for n in names if not spec.skipped(n)]
        phases = (
            ((0.0, DISTANCES[spec.distance]),)
            if spec.matching is None
            else aware_phases(spec.matching, spec.band_weight, spec.rounding_likelihood)
        )
        self.phases = [(start, self._eot(distance, defense, seed)) for start, distance in phases]
        self._losses: dict[tuple[int, tuple[Term, ...]], Callable[[torch.Tensor], torch.Tensor]] = {}

    def _eot(
        self, distance: Callable[..., torch.Tensor], defense: Any, seed: int
    ) -> Callable[[Gradients], torch.Tensor]:
        """``g -> (J,)``: the distance of ``g`` itself, or its mean over ``eot`` draws of the simulated defense."""
        target, compared, draws = self.problem.target, self.compared, self.spec.eot
        if not draws:
            return lambda g: distance([g[n] for n in compared], target)
        if defense is None:
            raise ValueError("eot > 0 needs the clients' defense (threat.defense = true)")
        generator = torch.Generator(device=target[0].device).manual_seed(seed)

        def expected(g: Gradients) -> torch.Tensor:
            names = list(g)
            total: torch.Tensor | float = 0
            for _ in range(draws):
                drawn = dict(zip(names, defense.simulate([g[n] for n in names], generator)))
                total = total + distance([drawn[n] for n in compared], target)
            return cast(torch.Tensor, total) / draws  # a tensor: draws >= 1

        return expected

    def phase_at(self, progress: float) -> int:
        """The index of the distance in force at ``progress`` (fraction of iterations): the last to have started."""
        return max(i for i, (start, _) in enumerate(self.phases) if progress >= start)

    def parts(
        self, z: torch.Tensor, priors: list[str], phase: int = -1
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Each job's gradient distance (J,) (the ``phase``-th; the last by default) and the value (J,) of each of
        ``priors`` at ``z``."""
        space, problem = self.problem.space, self.problem
        images = space.images(z)
        # without known labels the space is the joint one, whose points carry soft labels
        labels = problem.y if problem.y is not None else cast(JointSpace, space).soft_labels(z).to(self.dtype)
        batch, labels, weights = space.dummy_batch(z, labels)
        weighting = [] if weights is None else [weights.to(self.dtype)]
        g, statistics = self.update(self.params, batch.to(self.dtype), labels, *weighting)
        if self.dtype != torch.float32:
            g = {name: v.float() for name, v in g.items()}
            statistics = [(mean.float(), var.float()) for mean, var in statistics]
        inputs = TermInputs(images, z, statistics, problem.bn_target, self.spec.restarts, self.copies)
        return self.phases[phase][1](g), {name: PRIORS[name](inputs) for name in priors}

    def losses_at(self, progress: float) -> Callable[[torch.Tensor], torch.Tensor]:
        """``z -> (J,)`` weighted losses, a prior counted once ``progress`` (fraction of iterations) reaches its
        start, under the distance in force then; one function object per phase and set of counted priors."""
        active = tuple(t for t in self.spec.terms if t.weight > 0 and progress >= t.start)
        key = (self.phase_at(progress), active)
        if key not in self._losses:
            self._losses[key] = lambda z: self._weighted(z, *key)
        return self._losses[key]

    def _weighted(self, z: torch.Tensor, phase: int, active: tuple[Term, ...]) -> torch.Tensor:
        distance, priors = self.parts(z, [t.name for t in active], phase)
        return self.spec.distance_weight * distance + sum(t.weight * priors[t.name] for t in active)

    def selection(self, z: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(J,) losses over the terms that select restarts, and the distance and every prior (weighted or not),
        at the end point ``z``."""
        distance, priors = self.parts(z, [t.name for t in self.spec.terms])
        total = self.spec.distance_weight * distance + sum(
            t.weight * priors[t.name] for t in self.spec.terms if t.weight > 0 and t.selects
        )
        total = torch.where(torch.isfinite(total), total, torch.inf)
        return total, {"distance": distance, **priors}


def local_update_fn(
    param_grad: Callable[..., tuple[Gradients, Statistics]],
    schedule: LocalSchedule,
    examples: int,
    copies: int = 1,
    momenta: list[float] | None = None,
) -> Callable[..., tuple[Gradients, Statistics]]:
    """``(params, x, y) -> (params - params_after_local_SGD, running)``: the client's FedAvg steps replayed on
    dummy data ``x`` (copies * examples, ...), epoch e's minibatches cut in order from copy e (every epoch's
    from the one copy when ``copies`` is 1). With ``momenta`` (one per BatchNorm layer ``param_grad`` records,
    its unbiased variance), ``running`` is per layer what the steps add to the running mean and variance:
    ``sum_t m (1 - m)^(T - t) s_t`` over the T steps' statistics ``s_t``; else empty."""
    if copies not in (1, schedule.epochs):
        raise ValueError(f"{copies} copies of the examples for {schedule.epochs} local epochs: give 1 or one each")
    steps = [
        (epoch * examples * (copies > 1) + start, min(start + schedule.batch_size, examples) - start)
        for epoch in range(schedule.epochs)
        for start in range(0, examples, schedule.batch_size)
    ]

    def local_update(p: Gradients, x: torch.Tensor, labels: torch.Tensor) -> tuple[Gradients, Statistics]:
        q, running = p, cast(Statistics, [])
        for first, size in steps:
            g, statistics = param_grad(q, x[first : first + size], labels[first : first + size])
            q = {n: q[n] - schedule.lr * g[n] for n in q}
            if momenta:
                running = running or [(torch.zeros_like(mean), torch.zeros_like(var)) for mean, var in statistics]
                running = [
                    ((1 - m) * mean_sum + m * mean, (1 - m) * var_sum + m * var)
                    for m, (mean_sum, var_sum), (mean, var) in zip(momenta, running, statistics)
                ]
        return {n: p[n] - q[n] for n in p}, running

    return local_update
