"""One batched search behind every optimization attack: IG, DLG, iDLG, GradInversion and GGL are ``SearchSpec``s.

Per job (one captured upload, one restart) it minimizes over the space's variable ``z``::

    distance_weight * D(update(images(z)), target) + sum_k weight_k * prior_k(images(z), z)

where ``update`` is the parameter gradient of the dummy batch (FedSGD) or the replayed local training
``global - after`` (FedAvg), ``D`` a registered distance (``attackers.engine.terms``) over the parameters
``skip`` leaves in, and the priors are registered terms. All jobs of the uploads given together run as one
tensor program: ``torch.func.vmap`` over jobs of the parameter gradient (over the dummy batches only, with
the weights shared, when the uploads were computed at one global model: per-sample gradients of one
model instead of a copy of the weights per job), one ``torch.func.grad`` w.r.t. every job's variable.
Only restarts of one upload interact, and only through a ``group`` prior. The best restart of each upload
is the one with the lowest final loss over the terms that ``select``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from attackers.base import Reconstruction
from attackers.engine.compiled import Compiler
from attackers.engine.objective import Objective
from attackers.engine.optimizers import adam, lbfgs
from attackers.engine.problem import Problem
from attackers.engine.spec import SearchSpec
from attackers.jobs import resolve_device
from fedguard.observation import Observation


def search(
    spec: SearchSpec, observations: list[Observation], seed: int, *, decoder: Any = None, defense: Any = None
) -> list[Reconstruction]:
    """Reconstruct the batches behind ``observations`` (one model, data shape, batch size and upload kind)
    from the starting points ``seed`` gives; ``decoder``: search a generator's latents; ``defense``: the
    clients' defense, simulated for EOT."""
    if not observations:
        return []
    start = time.perf_counter()
    device = resolve_device(spec.device)
    problem = Problem.of(spec, observations, device, decoder)
    objective = Objective(spec, problem, defense, seed)
    z = torch.stack([problem.space.start(problem.generator(seed, j)) for j in range(problem.jobs)]).to(device)
    compiler = Compiler(
        spec.compile, device, spec.iterations, (dataclasses.replace(spec, iterations=1), z.shape), spec.precision
    )
    resets = torch.zeros(problem.jobs, dtype=torch.long)
    if spec.optimizer.kind == "lbfgs":
        z, resets = lbfgs(
            z,
            objective.losses_at,
            spec.iterations,
            spec.optimizer,
            problem.space.project_,
            problem.fresh_starts(seed),
            compiler,
        )
    else:
        z = adam(z, objective.losses_at, spec.iterations, spec.optimizer, problem.space.project_, compiler)
    with torch.no_grad():
        final, parts = objective.selection(z)
        images = problem.space.final_images(z)
        labels = problem.final_labels(z)
    return problem.reconstructions(z, final, parts, images, labels, resets.cpu(), time.perf_counter() - start)
