"""DP-SGD (Abadi et al., "Deep Learning with Differential Privacy", CCS 2016) as a client defense.

For the local batch (x_i, y_i), i = 1..B, at the global parameters w:

    g_i     = grad_w loss(f_w(x_i), y_i)                      per-sample gradient, all trainable tensors
    g~_i    = g_i * min(1, C / ||g_i||_2)                     clipped, the norm over all tensors together
    upload  = (sum_i g~_i + N(0, (sigma C)^2 I)) / B          noise of std sigma*C on every entry

with C = ``clip`` and sigma = ``noise_multiplier``: the noisy mean gradient of the paper's Algorithm 1, which
adds the noise to the sum and divides by the (expected) batch size. The per-sample gradients come from
``torch.func.vmap(grad(...))`` over ``functional_call`` of the model on one sample at a time, with detached
copies of the trainable parameters, so ``step.model`` is left untouched; ``step.grads`` is not used.

Decisions where the paper is silent or the setting differs:

* Under FedSGD the upload is one DP-SGD gradient of the batch at the global model. Under FedAvg (a protocol
  that uploads models and ``defends_steps``) every local step follows this gradient of its own batch at the
  current parameters, as Abadi et al.'s Algorithm 1 trains, and the upload is the model the steps reach; each
  step is one step of the accountant (``fedguard.defenses.base.step_gradient``).
* BatchNorm in training mode normalises each sample by statistics of the whole batch, so a sample's
  gradient depends on the others and per-sample clipping bounds nothing: models with BatchNorm are refused
  (ValueError), as Opacus refuses them (it suggests GroupNorm instead).
* The divisor is the actual batch size B (not an expected lot size: the batch has a fixed size).
* Accounting: each call is one step of the Sampled Gaussian Mechanism with sampling rate q = B / N, where N
  is ``dataset_size`` when set, else the size of the client's local data set (``LocalStep.examples``); with
  neither, q = 1, i.e. no amplification by subsampling, which is always a valid bound. ``state`` keeps the
  number of steps this client has taken and the largest sampling rate seen (RDP grows with q, so the largest
  one bounds every step). ``epsilon`` converts them to (epsilon, delta)-DP with the RDP accountant of
  ``fedguard.defenses.accountant``; the guarantee is per client, for the samples of its local data set, and
  assumes Poisson sampling (the fixed-size batch without replacement is the usual approximation).
* No ``simulate``: per-sample clipping needs the per-sample gradients, which an attacker holding only an
  aggregated gradient cannot re-create.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

from fedguard.defenses.accountant import epsilon_spent
from fedguard.defenses.base import LocalStep, class_traits, register_defense
from fedguard.defenses.revealed import ClippedNoise
from fedguard.limits import MAX_NOISE_STD, SGM_NOISE_RANGE

STEPS, SAMPLE_RATE = "steps", "sample_rate"  # keys of the defense state


@dataclass(frozen=True)
class DPSGDParams:
    """``clip``: per-sample L2 bound C; ``noise_multiplier``: sigma, the noise std on the sum is sigma*C;
    ``dataset_size``: the client's local data set size N, so that q = B / N (0: the size the client reports, or
    q = 1 without one); ``delta``: the delta at which the spent epsilon is reported."""

    clip: float = 1.0
    noise_multiplier: float = 1.0
    dataset_size: int = 0
    delta: float = 1e-5

    def __post_init__(self) -> None:
        if not (self.clip > 0 and math.isfinite(self.clip)):
            raise ValueError(f"clip must be finite and > 0, got {self.clip}")
        low, high = SGM_NOISE_RANGE
        if not (self.noise_multiplier == 0 or low <= self.noise_multiplier <= high):
            raise ValueError(
                f"noise-multiplier must be 0 (no noise) or in [{low:g}, {high:g}] (fedguard.limits.SGM_NOISE_RANGE: "
                f"where the privacy accountant can compute epsilon), got {self.noise_multiplier}"
            )
        if not self.clip * self.noise_multiplier < MAX_NOISE_STD:
            raise ValueError(
                f"the noise std on the sum, clip * noise-multiplier = {self.clip * self.noise_multiplier:g}: must be "
                f"< {MAX_NOISE_STD:g} (fedguard.limits.MAX_NOISE_STD: float32 uploads would hold infinities)"
            )
        if self.dataset_size < 0:
            raise ValueError(f"dataset-size must be >= 0 (0: the client's own data set size), got {self.dataset_size}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")


def refuse_batch_norm(model: nn.Module) -> None:
    """Raise ValueError if ``model`` has a BatchNorm layer."""
    norms = [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if norms:
        raise ValueError(
            "dp-sgd needs per-sample gradients, and BatchNorm mixes the samples of a batch "
            f"(layers {', '.join(norms)}); "
            "use a model without BatchNorm (e.g. GroupNorm instead)"
        )


def per_sample_gradients(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> list[torch.Tensor]:
    """Gradient of ``loss_fn`` on each sample alone: one (B, *shape) tensor per trainable parameter, in order.

    ``x`` (B, ...) and ``y`` (B,); the model is evaluated in its current mode, its tensors are not changed.
    """
    refuse_batch_norm(model)
    trainable = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    fixed = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    fixed.update({n: b.detach() for n, b in model.named_buffers()})

    def sample_loss(params: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, (params, fixed), (xi.unsqueeze(0),))
        return loss_fn(logits, yi.unsqueeze(0))

    grads = vmap(grad(sample_loss), in_dims=(None, 0, 0))(trainable, x, y)
    return [grads[n] for n in trainable]


def clip_factors(grads: list[torch.Tensor], clip: float) -> torch.Tensor:
    """min(1, clip / ||g_b||) per sample b (B,), the norm over row b of all (B, ...) tensors together."""
    squares = cast(torch.Tensor, sum(g.flatten(1).pow(2).sum(1) for g in grads))  # a tensor: there are gradients
    norms = torch.sqrt(squares)  # pairwise sums: ~1e-7 relative in float32
    return torch.clamp(clip / (norms + 1e-12), max=1.0)


def sample_rate(params: DPSGDParams, batch_size: int, examples: int = 0) -> float:
    """q = B / N of a batch of ``batch_size``: N is ``dataset_size``, else ``examples`` (the client's data set
    size), else q = 1."""
    size = params.dataset_size or examples
    if size == 0:
        return 1.0
    if batch_size > size:
        raise ValueError(
            f"a batch of {batch_size} samples exceeds the data set size {size} (defense.dp-sgd.dataset-size)"
        )
    return batch_size / size


def epsilon(state: dict[str, torch.Tensor], params: DPSGDParams, delta: float = 1e-5) -> float:
    """Epsilon of (epsilon, ``delta``)-DP spent by this client's steps so far (0 before any)."""
    if STEPS not in state:
        return 0.0
    return epsilon_spent(params.noise_multiplier, float(state[SAMPLE_RATE]), int(state[STEPS]), delta)


class DPSGD:
    """Per-sample clipping to ``clip``, Gaussian noise of std ``noise_multiplier * clip`` on the sum, mean over B."""

    def __init__(self, params: DPSGDParams) -> None:
        self.params = params

    check_model = staticmethod(refuse_batch_norm)  # checked when the run is configured, not at the first step

    def __call__(self, step: LocalStep, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        batch = len(step.y)
        rate = sample_rate(self.params, batch, step.examples)
        grads = per_sample_gradients(step.model, step.x, step.y, step.loss_fn)
        factors = clip_factors(grads, self.params.clip)
        scale = self.params.noise_multiplier * self.params.clip
        sent = []
        for g in grads:
            total = torch.tensordot(factors, g, dims=1)  # sum of the clipped per-sample gradients
            if scale > 0:
                noise = torch.randn(
                    total.shape, generator=step.generator, dtype=total.dtype, device=step.generator.device
                )
                total = total + scale * noise.to(total.device)
            sent.append(total / batch)
        self._count(state, rate)
        return sent

    @staticmethod
    def _count(state: dict[str, torch.Tensor], rate: float) -> None:
        """One more step in ``state``; the sampling rate kept is the largest so far."""
        steps = int(state[STEPS]) if STEPS in state else 0
        largest = max(rate, float(state[SAMPLE_RATE])) if SAMPLE_RATE in state else rate
        state[STEPS] = torch.tensor(steps + 1, dtype=torch.int64)
        state[SAMPLE_RATE] = torch.tensor(largest, dtype=torch.float64)

    defends_steps = True  # under FedAvg, every local step (module docstring)

    def revealed(self) -> ClippedNoise:
        """The mean of per-example gradients clipped to ``clip``, plus zero-mean noise: std ``noise_multiplier *
        clip`` on their sum, divided by the batch with it."""
        return ClippedNoise(self.params.clip, self.params.noise_multiplier * self.params.clip, per_example=True)

    def report(self, state: dict[str, torch.Tensor]) -> dict[str, float]:
        """``spent`` for rounds.jsonl; epsilon is left out when infinite (noise-multiplier 0: no guarantee)."""
        return {k: v for k, v in self.spent(state).items() if math.isfinite(v)}

    def spent(self, state: dict[str, torch.Tensor]) -> dict[str, float]:
        """{'epsilon', 'delta', 'steps', 'sample-rate'} of this client so far, for the round's record."""
        return {
            "epsilon": epsilon(state, self.params, self.params.delta),
            "delta": self.params.delta,
            "steps": float(state[STEPS]) if STEPS in state else 0.0,
            "sample-rate": float(state[SAMPLE_RATE]) if SAMPLE_RATE in state else 0.0,
        }


@register_defense("dp-sgd", params=DPSGDParams, traits=class_traits(DPSGD))
def build_dp_sgd(params: DPSGDParams) -> DPSGD:
    """DP-SGD: per-sample L2 clipping and Gaussian noise, with an RDP privacy accountant."""
    return DPSGD(params)
