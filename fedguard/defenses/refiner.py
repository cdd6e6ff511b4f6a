"""Refiner: upload the gradient of synthesized robust data (Fan et al., "Refiner: Data Refining against Gradient
Leakage Attacks in Federated Learning").

The client does not upload its true gradient ``g = grad_theta L(F_theta(x), y)``. It builds robust data ``x*``
(same shape as ``x``, labels ``y`` unchanged) that an evaluation network D rates as noise while its gradient
stays close to ``g`` on the parameters that matter, and uploads the gradient of ``x*`` projected into the L2
ball of radius ``r`` around ``g`` (``r = epsilon * ||g||`` by default, see the decisions):

- Eq 2: ``x* = argmin UM(x*, x) - beta * PM(x*, x)``.
- Eq 3-4, utility: ``UM = sum_i sum_j (w_ij * (g*_ij - g_ij))^2`` over the elements j of every parameter tensor
  of layer i, with ``g* = grad_theta L(F_theta(x*), y)`` and the constant weight
  ``w_ij = |g_ij * theta_ij| * tau^i`` (element-wise |grad * value|, layer-wise decay ``tau^i``).
- Sec 3.3, privacy: ``PM = mean_b D(x*_b)``, D's predicted noise ratio (0: natural image, 1: uniform noise),
  see ``fedguard.defenses.evalnet``.
- Sec 3.4, noise-blended start: ``x*_0 = (1 - alpha) * x + alpha * v`` with ``v ~ U(0, 1)`` per pixel;
  then ``iterations`` (iota) plain gradient steps ``x* <- clamp(x* - lr * grad_x* (UM - beta * PM), 0, 1)``.
- Sec 4.1 and Appendix J, projection: ``g_up = g*`` if ``||g* - g|| <= r``, else
  ``g + r * (g* - g) / ||g* - g||``; every norm runs over all parameter tensors together. So
  ``||g_up - g|| <= r`` always: computed in float64, then rounded to the gradient's dtype element-wise
  towards ``g``, which keeps the bound after rounding.
- Sec 6.3, warm start: robust data of an earlier round initializes the next one (no re-blending) and takes
  ``warm_iterations`` (5 in the paper) steps instead of ``iterations``.

Decisions where the paper is silent or ambiguous (A-numbers as in the reading notes on the paper):

- A1: Eq 4 puts the weight inside the square (``sum (w * delta)^2``), the prose reads ``sum w * delta^2``;
  ``weight_power`` = 2 (default) is the equation, 1 the prose.
- A2: PM is the batch mean of D(x*), so that ``beta`` does not scale with the batch size.
- A6: the step on x* is plain gradient descent with step ``lr`` = 1 (the only rate the paper states, Fig 5) and
  x* is clamped to [0, 1] after every step (D was trained on [0, 1] images; the upload must come from valid
  images).
- A13: a "layer" is a module holding trainable parameters, numbered from 1 in registration order (weight and
  bias of one module share ``tau^i``; BatchNorm layers count).
- A14: ``|g * theta|`` is tiny, so UM is orders of magnitude below ``beta * PM`` and utility is carried mostly
  by the projection; implemented literally, with no normalization of the weights. ``last`` reports
  UM and PM separately.
- Radius (note N1): the paper's epsilon is an absolute L2 radius (0.01 ... 0.9 in its sweeps, 0.1 in its
  ablations); ``radius = "absolute"`` with ``epsilon = 0.1`` is that parameterisation. The project's default is
  ``radius = "relative"``, ``r = epsilon * ||g||`` with ``epsilon = 0.25``, because gradient norms differ about
  75x between the preset settings: on LeNet, 32x32 photos, batch 1 (||g|| 27 to 31) an absolute 0.1 moves the
  upload by 0.3% and iDLG still reaches 29.5 dB; on the MLP, MNIST, batch 32 (||g|| 0.42) it is a 24% change.
  The relative 0.25 brought iDLG on the LeNet to 12.4 dB and kept 99% of the MLP's accuracy.
- Other defaults are the paper's (alpha 0.5, beta 1, iota 10, tau 0.95). Warm start is off by default, as in
  the paper's main results.
- A5, warm-start cache (only with ``warm_start``): ``LocalStep`` carries no sample identities, so the cache is
  per client, not per sample: ``state['x_star']`` keeps the previous round's robust data (float16, the robust
  data x* itself after its gradient steps, not the upload) and is used whenever the new batch has the same
  shape. For a client whose batch is its whole local set (or the same samples again) this is the paper's warm
  start; for a fresh random batch it starts from robust data that holds nothing of the new images, and the
  projection still bounds the upload's distance from the true gradient.
- ``g`` is ``step.grads``: the batch gradient under FedSGD, the protocol of the paper. Under FedAvg
  ``step.grads`` is a weight difference that ``grad_theta L(x*)`` does not estimate; use FedSGD.
- The extra forward passes run through ``torch.func.functional_call`` with copies of the model's buffers, in
  the model's current mode (train mode, batch statistics, as the client's step): BatchNorm running statistics
  and the parameters of ``step.model`` are never changed.

Diagnostics: ``report(state)`` gives the latest upload's ``upload.grad-norm`` ``||g||``, ``upload.distance``
``||g* - g||`` before the projection, ``upload.radius`` r and ``upload.moved`` ``||g_up - g||`` (kept in
``state`` as 0-d float64 tensors); the attribute ``last`` (``RefinerStats``) has the same numbers, UM and PM per
step, and the start and the robust data of the last call.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from torch.func import functional_call

from fedguard.defenses.base import DefenseTraits, LocalStep, register_defense
from fedguard.defenses.dp_update import global_norm
from fedguard.defenses.evalnet import TrainedEvalNet, load_evalnet
from fedguard.defenses.evalnet.store import COMMAND
from fedguard.defenses.revealed import TowardsRobustData
from fedguard.registry import MissingTrainedFile, RequiredFile, TrainedFileError

CACHE_KEY = "x_star"
RADII = ("relative", "absolute")
NO_EVALNET = (
    "defense 'refiner' needs an evaluation network: set defense.refiner.evalnet to a file made by "
    f"`{COMMAND}` (by default evalnets/<dataset>.npz)"
)
REPORTED = {"grad-norm": "grad_norm", "distance": "raw_distance", "radius": "radius", "moved": "moved"}  # name: key


@dataclass(frozen=True)
class RefinerParams:
    """``evalnet``: a ``.npz`` from ``fedguard train-evalnet`` (required; relative to the current directory);
    ``epsilon``: radius of the L2 ball around the true gradient g, a multiple of ||g|| (``radius`` "relative") or
    in gradient units ("absolute", the paper's); ``radius``: how ``epsilon`` is read; ``alpha``: noise share of
    the start; ``beta``: weight of the privacy term; ``tau``: layer-wise decay; ``iterations``: gradient steps on
    x* (iota); ``lr``: step on x*; ``weight_power``: 2 = Eq 4's (w * delta)^2, 1 = w * delta^2; ``warm_start``:
    start from the previous round's robust data; ``warm_iterations``: steps when warm-started."""

    evalnet: str = ""
    epsilon: float = 0.25
    radius: str = "relative"
    alpha: float = 0.5
    beta: float = 1.0
    tau: float = 0.95
    iterations: int = 10
    lr: float = 1.0
    weight_power: int = 2
    warm_start: bool = False
    warm_iterations: int = 5

    def __post_init__(self) -> None:
        for name in ("epsilon", "beta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be finite and > 0, got {self.lr}")
        for name in ("alpha", "tau"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("iterations", "warm_iterations"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.weight_power not in (1, 2):
            raise ValueError(f"weight-power must be 1 (w * delta^2) or 2 ((w * delta)^2), got {self.weight_power}")
        if self.radius not in RADII:
            raise ValueError(f"radius {self.radius!r}: choose one of {', '.join(RADII)}")


@dataclass(frozen=True)
class RefinerStats:
    """One call: ``grad_norm`` ||g||, ``raw_distance`` ||g* - g|| before and ``distance`` ||g_up - g|| after the
    projection, ``radius`` r of the ball (floats, gradient units); ``utility`` and ``privacy``: UM and PM before
    each step (iterations,); ``warm``: started from the cache; ``start`` x*_0 and ``robust`` x* (B, C, H, W)."""

    grad_norm: float
    raw_distance: float
    distance: float
    radius: float
    utility: torch.Tensor
    privacy: torch.Tensor
    warm: bool
    start: torch.Tensor
    robust: torch.Tensor


def distance_of(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """``||a - b||`` over all tensors together, subtracting in float64 (a 0-d float64 tensor)."""
    return global_norm([u.double() - t.double() for u, t in zip(a, b)])


def round_towards(target: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """``target`` (float64) rounded to ``anchor``'s dtype, element-wise never farther from ``anchor`` than it is."""
    rounded = target.to(anchor.dtype)
    overshoot = (rounded.double() - anchor.double()).abs() > (target - anchor.double()).abs()
    return torch.where(overshoot, torch.nextafter(rounded, anchor), rounded)


def project(
    upload: list[torch.Tensor], true: list[torch.Tensor], radius: float
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The point of the L2 ball of radius ``radius`` around ``true`` closest to ``upload`` (Appendix J), and
    ``||upload - true||`` (float64, before projection).

    ``upload`` itself when it is inside; else ``true + radius * (upload - true) / ||upload - true||``, computed in
    float64 and rounded element-wise towards ``true``, so that ``||result - true|| <= radius`` holds after
    rounding too (round-to-nearest could overshoot by about one unit in the last place of ``true``)."""
    diff = [u.double() - t.double() for u, t in zip(upload, true)]
    norm = global_norm(diff)
    if norm <= radius:
        return list(upload), norm
    scale = radius / norm
    return [round_towards(t.double() + scale * d, t) for t, d in zip(true, diff)], norm


def layer_indices(model: nn.Module) -> list[int]:
    """For each trainable parameter: the 1-based index of its module among the modules holding trainable ones."""
    modules: dict[str, int] = {}
    indices = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            module = name.rpartition(".")[0]
            indices.append(modules.setdefault(module, len(modules) + 1))
    return indices


class Refiner:
    """Upload the gradient of robust data rated as noise by the evaluation network, projected into the ball of
    radius r around the true gradient."""

    protocols = frozenset({"fedsgd"})  # the upload must be a batch gradient that robust data can match

    def __init__(self, params: RefinerParams, evalnet: TrainedEvalNet, path: Path) -> None:
        self.params, self.evalnet, self.path = params, evalnet, path
        self.last: RefinerStats | None = None

    def revealed(self) -> TowardsRobustData:
        """The upload: g moved at most ``epsilon`` (times ||g|| when relative) towards the robust data's gradient."""
        return TowardsRobustData(self.params.epsilon, relative=self.params.radius == "relative")

    def report(self, state: dict[str, torch.Tensor]) -> dict[str, float]:
        """Numbers about this client's latest upload, in gradient units: ``upload.grad-norm`` ||g||,
        ``upload.distance`` ||g* - g|| before the projection, ``upload.radius`` r, ``upload.moved`` ||g_up - g||."""
        return {f"upload.{name}": float(state[key]) for name, key in REPORTED.items() if key in state}

    def radius_of(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """The ball's radius r for a true gradient of norm ``grad_norm`` (0-d float64, gradient units)."""
        p = self.params
        return p.epsilon * grad_norm if p.radius == "relative" else torch.tensor(p.epsilon, dtype=torch.float64)

    def __call__(self, step: LocalStep, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        p = self.params
        x = step.x.detach()
        self.evalnet.check_shape(tuple(x.shape[1:]), self.path)
        cached = state.get(CACHE_KEY)
        warm = p.warm_start and cached is not None and tuple(cached.shape) == tuple(x.shape)
        if warm and cached is not None:
            start, iterations = cached.to(x.device, x.dtype), p.warm_iterations
        else:
            noise = torch.rand(x.shape, generator=step.generator, dtype=x.dtype, device=step.generator.device)
            start, iterations = (1 - p.alpha) * x + p.alpha * noise.to(x.device), p.iterations
        true = [g.detach() for g in step.grads]
        gradients = self.gradient_fn(step)
        robust, utility, privacy = self.refine(step.model, gradients, true, start, iterations)
        robust_grads = gradients(robust, False)
        grad_norm = global_norm(true)
        radius = self.radius_of(grad_norm)
        upload, raw_distance = project(robust_grads, true, float(radius))
        moved = distance_of(upload, true)
        if p.warm_start:
            state[CACHE_KEY] = robust.to(torch.float16)
        numbers = {"grad_norm": grad_norm, "raw_distance": raw_distance, "radius": radius, "moved": moved}
        state.update({key: value.detach().cpu() for key, value in numbers.items()})
        self.last = RefinerStats(
            float(grad_norm), float(raw_distance), float(moved), float(radius), utility, privacy, warm, start, robust
        )
        return upload

    @staticmethod
    def gradient_fn(step: LocalStep) -> Callable[[torch.Tensor, bool], list[torch.Tensor]]:
        """``(images, create_graph) -> grad_theta L(F_theta(images), step.y)`` for each trainable parameter.

        Runs the model functionally on copies of its buffers (BatchNorm statistics of ``step.model`` stay
        untouched) and on detached leaves of its parameters."""
        model = step.model
        leaves = {name: p.detach().requires_grad_(p.requires_grad) for name, p in model.named_parameters()}
        trainable = [leaves[name] for name, p in model.named_parameters() if p.requires_grad]
        buffers = {name: b.clone() for name, b in model.named_buffers()}

        def gradients(images: torch.Tensor, create_graph: bool) -> list[torch.Tensor]:
            loss = step.loss_fn(functional_call(model, {**leaves, **buffers}, (images,)), step.y)
            grads = torch.autograd.grad(loss, trainable, create_graph=create_graph)
            return list(grads) if create_graph else [g.detach() for g in grads]

        return gradients

    def refine(
        self,
        model: nn.Module,
        gradients: Callable[[torch.Tensor, bool], list[torch.Tensor]],
        true: list[torch.Tensor],
        start: torch.Tensor,
        iterations: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Robust data: ``iterations`` clamped gradient steps on UM - beta * PM from ``start`` (B, C, H, W).

        ``gradients`` is ``gradient_fn``'s; ``true`` the true gradient g. Returns x* and UM and PM before each
        step (iterations,)."""
        p = self.params
        params = [q for q in model.parameters() if q.requires_grad]
        # UM = sum ((w * delta)^2) or sum (w * delta^2) = sum ((root * delta)^2) with root = w^(power / 2)
        roots = [
            ((g * q.detach()).abs() * p.tau**layer).pow(p.weight_power / 2)
            for g, q, layer in zip(true, params, layer_indices(model))
        ]
        net = self.evalnet.net.to(start.device)
        robust = start.detach().clamp(0, 1)
        utility, privacy = [], []
        for _ in range(iterations):
            robust.requires_grad_(True)
            grads = gradients(robust, True)
            um = sum(torch.linalg.vector_norm(r * (g - t)).square() for r, g, t in zip(roots, grads, true))
            pm = net(robust).mean()
            (direction,) = torch.autograd.grad(um - p.beta * pm, robust)
            robust = (robust.detach() - p.lr * direction).clamp_(0, 1)
            utility.append(um.detach())
            privacy.append(pm.detach())
        empty = torch.zeros(0)
        return (robust.detach(), torch.stack(utility) if utility else empty, torch.stack(privacy) if privacy else empty)


def missing_evalnet(evalnet: str) -> str:
    """Why no evaluation network loads from ``evalnet``, and how to make one."""
    return (
        f"defense 'refiner': no evaluation network at {evalnet_path(evalnet)} "
        f"(defense.refiner.evalnet = {evalnet!r}); create it with `{COMMAND} --out {evalnet}`"
    )


def evalnet_path(evalnet: str) -> Path:
    """The file ``defense.refiner.evalnet`` names, relative to the current directory."""
    return Path(evalnet).expanduser().absolute()


def read_evalnet(evalnet: str) -> TrainedEvalNet:
    """The evaluation network ``defense.refiner.evalnet`` names; ``TrainedFileError`` (``MissingTrainedFile`` for
    a missing file) saying what is wrong with it and how to make a good one."""
    path = evalnet_path(evalnet)
    if not path.exists():
        raise MissingTrainedFile(missing_evalnet(evalnet))
    try:
        return load_evalnet(path)
    except TrainedFileError as error:
        raise TrainedFileError(f"defense 'refiner': {error}") from None


def refiner_traits(params: RefinerParams) -> DefenseTraits:
    """The class's traits and the evaluation network its clients load."""
    evalnet = RequiredFile(
        "evalnet",
        params.evalnet,
        NO_EVALNET,
        missing_evalnet(params.evalnet),
        read_evalnet,
        lambda trained, spec: trained.check_shape(spec.shape, evalnet_path(params.evalnet)),
    )
    return DefenseTraits.of(Refiner, files=(evalnet,))


@register_defense("refiner", params=RefinerParams, traits=refiner_traits)
def build_refiner(params: RefinerParams) -> Refiner:
    """Refiner (Fan et al.): upload the gradient of robust data rated as noise, projected near the true one."""
    if not params.evalnet:
        raise ValueError(NO_EVALNET)
    return Refiner(params, read_evalnet(params.evalnet), evalnet_path(params.evalnet))
