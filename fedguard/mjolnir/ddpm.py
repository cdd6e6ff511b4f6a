"""The gradient diffusion model's forward process and its training (Mjölnir Algorithm 2, Ho et al. 2020).

Steps are 0-based: step k is the paper's t = k + 1. ``betas[k]`` is linear from
``beta_start`` to ``beta_end`` over ``steps`` steps (the code's 1e-4 -> 0.02
over 1000), ``alphas = 1 - betas`` and ``alpha_bars[k] = prod(alphas[:k + 1])``
(the paper's gamma_t). The forward marginal (Eq. 9) is
``q(x_k | x_0) = N(sqrt(alpha_bars[k]) x_0, (1 - alpha_bars[k]) I)``.

Training draws k uniformly from {0, ..., steps - 1} and fits eps_theta(x_k, k)
to the noise with the unweighted loss of Algorithm 2 (mean squared error),
or a Huber loss as in the released code. The epoch with the lowest mean loss
is the one kept, as the code does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import torch
import torch.nn.functional as F

from fedguard.mjolnir.unet import UNet, UNetConfig

LOSSES = ("mse", "huber")


@dataclass(frozen=True)
class Schedule:
    """Linear beta schedule over ``steps`` steps; the tensors are float64 on the CPU, indexed by 0-based step."""

    steps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if not 0 < self.beta_start <= self.beta_end < 1:
            raise ValueError(
                f"betas must satisfy 0 < beta_start <= beta_end < 1, got beta_start={self.beta_start}, "
                f"beta_end={self.beta_end}"
            )

    @cached_property
    def betas(self) -> torch.Tensor:
        """(steps,) noise variance added at each step."""
        return torch.linspace(self.beta_start, self.beta_end, self.steps, dtype=torch.float64)

    @cached_property
    def alphas(self) -> torch.Tensor:
        """(steps,) ``1 - betas``."""
        return 1 - self.betas

    @cached_property
    def alpha_bars(self) -> torch.Tensor:
        """(steps,) cumulative products of ``alphas``, decreasing from ``alphas[0]``."""
        return torch.cumprod(self.alphas, dim=0)

    def to_dict(self) -> dict:
        """JSON-ready fields."""
        return {"steps": self.steps, "beta_start": self.beta_start, "beta_end": self.beta_end}


def q_sample(schedule: Schedule, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``sqrt(abar[t]) x0 + sqrt(1 - abar[t]) noise`` for grids ``x0`` and ``noise`` (N, 1, S, S), steps ``t`` (N,)."""
    alpha_bar = schedule.alpha_bars.to(x0.device)[t].to(x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
    return alpha_bar.sqrt() * x0 + (1 - alpha_bar).sqrt() * noise


def diffusion_loss(
    model: torch.nn.Module, schedule: Schedule, x0: torch.Tensor, generator: torch.Generator, loss: str = "mse"
) -> torch.Tensor:
    """Algorithm 2's loss on a batch ``x0`` (N, 1, S, S): one uniform step and noise draw per grid, mean per entry."""
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r}: choose one of {', '.join(LOSSES)}")
    t = torch.randint(0, schedule.steps, (len(x0),), generator=generator, device=x0.device)
    noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
    predicted = model(q_sample(schedule, x0, t, noise), t)
    if loss == "mse":
        return F.mse_loss(predicted, noise)
    return F.smooth_l1_loss(predicted, noise)


@dataclass(frozen=True)
class DDPMTrainOptions:
    """Epochs, minibatch size, Adam step, seed (weights, batches, steps and noise), loss (mse | huber), schedule.

    Defaults after the released code: 20 epochs, Adam with step 1e-4, seed 1234, the linear 1000-step schedule;
    minibatches of 16 (the code's 8 is slow on a CPU) and the paper's squared error rather than the code's Huber."""

    epochs: int = 20
    batch_size: int = 16
    lr: float = 1e-4
    seed: int = 1234
    loss: str = "mse"
    schedule: Schedule = field(default_factory=Schedule)

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss {self.loss!r}: choose one of {', '.join(LOSSES)}")


@dataclass(frozen=True)
class DDPMEpoch:
    """One finished epoch: mean loss (squared noise error per entry for mse) and wall-clock seconds."""

    epoch: int
    epochs: int
    loss: float
    seconds: float

    def __str__(self) -> str:
        return f"epoch {self.epoch}/{self.epochs}: loss {self.loss:.4f}, {self.seconds:.1f} s"


def train_ddpm(
    images: torch.Tensor,
    config: UNetConfig,
    options: DDPMTrainOptions = DDPMTrainOptions(),
    progress: Callable[[DDPMEpoch], None] | None = None,
) -> tuple[UNet, list[float]]:
    """Train eps_theta on grids ``images`` (N, 1, S, S), already normalized, on their device.

    Returns the network of the lowest-loss epoch (eval mode, frozen) and every epoch's mean loss."""
    if images.dim() != 4 or images.shape[1] != 1 or images.shape[2] != images.shape[3]:
        raise ValueError(f"images must have shape (N, 1, S, S), got {tuple(images.shape)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(options.seed)
        model = UNet(config, images.shape[-1]).to(images.device)
    generator = torch.Generator(device=images.device).manual_seed(options.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=options.lr)
    losses: list[float] = []
    best = None
    for epoch in range(1, options.epochs + 1):
        start, total = time.perf_counter(), torch.zeros((), device=images.device)
        order = torch.randperm(len(images), generator=generator, device=images.device)
        for batch in order.split(options.batch_size):
            loss = diffusion_loss(model, options.schedule, images[batch], generator, options.loss)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(batch)
        losses.append(float(total) / len(images))
        if best is None or losses[-1] < min(losses[:-1]):
            best = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        if progress is not None:
            progress(DDPMEpoch(epoch, options.epochs, losses[-1], time.perf_counter() - start))
    model.load_state_dict(best)
    return model.eval().requires_grad_(False), losses
