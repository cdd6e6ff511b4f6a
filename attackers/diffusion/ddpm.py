"""The gradient diffusion model's forward process and its training (Mjölnir Algorithm 2, Ho et al. 2020).

Steps are 0-based: step k is the paper's t = k + 1. ``betas[k]`` is linear from
``beta_start`` to ``beta_end`` over ``steps`` steps (the code's 1e-4 -> 0.02
over 1000), ``alphas = 1 - betas`` and ``alpha_bars[k] = prod(alphas[:k + 1])``
(the paper's gamma_t). The forward marginal (Eq. 9) is
``q(x_k | x_0) = N(sqrt(alpha_bars[k]) x_0, (1 - alpha_bars[k]) I)``.

Training draws k uniformly from {0, ..., steps - 1} and fits eps_theta(x_k, k)
to the noise with the unweighted loss of Algorithm 2 (mean squared error),
or a Huber loss as in the released code. The epoch with the lowest mean loss
is the one kept, as the code does. With a ``noise_range`` the model is the
conditional one: eps_theta(x_k, k, condition), the condition a fresh noisy
copy of each clean grid (``attackers.diffusion.condition``).

Resuming. After any epoch the run is a ``TrainState`` (weights, Adam's state,
the generator's state, the losses and the lowest-loss weights); training from
it to E epochs gives the weights and losses of one uninterrupted run of E
epochs, bit for bit, on the same device and thread count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from attackers.diffusion.condition import check_noise_range, noisy_condition
from attackers.diffusion.unet import UNet, UNetConfig
from fedguard.trained.fitting import EpochStats, check_options

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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {"steps": self.steps, "beta_start": self.beta_start, "beta_end": self.beta_end}


def q_sample(schedule: Schedule, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``sqrt(abar[t]) x0 + sqrt(1 - abar[t]) noise`` for grids ``x0`` and ``noise`` (N, 1, S, S), steps ``t`` (N,)."""
    alpha_bar = schedule.alpha_bars.to(x0.device)[t].to(x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
    return alpha_bar.sqrt() * x0 + (1 - alpha_bar).sqrt() * noise


def diffusion_loss(
    model: torch.nn.Module,
    schedule: Schedule,
    x0: torch.Tensor,
    generator: torch.Generator,
    loss: str = "mse",
    noise_range: tuple[float, float] | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Algorithm 2's loss on a batch ``x0`` (N, 1, S, S): one uniform step and noise draw per grid, mean per entry.

    ``noise_range`` (M_min, M_max): the conditional model's loss, the condition of each grid drawn after the step
    and the noise (``noisy_condition``, its noise on the entries of ``mask``, (1, S, S) bool, all by default); only
    x0 is diffused."""
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r}: choose one of {', '.join(LOSSES)}")
    t = torch.randint(0, schedule.steps, (len(x0),), generator=generator, device=x0.device)
    noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
    if noise_range is None:
        predicted = model(q_sample(schedule, x0, t, noise), t)
    else:
        predicted = model(q_sample(schedule, x0, t, noise), t, noisy_condition(x0, noise_range, generator, mask))
    if loss == "mse":
        return F.mse_loss(predicted, noise)
    return F.smooth_l1_loss(predicted, noise)


@dataclass(frozen=True)
class DDPMTrainOptions:
    """Epochs, minibatch size, Adam step, seed (weights, batches, steps and noise), loss (mse | huber), schedule,
    and ``noise_range``: None for the unconditional model (the default), (M_min, M_max) for the conditional one
    trained on conditions of noise levels in that range (``attackers.diffusion.condition``; M_min == M_max: fixed).

    Defaults after the released code: 20 epochs, Adam with step 1e-4, seed 1234, the linear 1000-step schedule;
    minibatches of 16 (the code's 8 is slow on a CPU) and the paper's squared error rather than the code's Huber."""

    epochs: int = 20
    batch_size: int = 16
    lr: float = 1e-4
    seed: int = 1234
    loss: str = "mse"
    schedule: Schedule = field(default_factory=Schedule)
    noise_range: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.noise_range is not None:
            object.__setattr__(self, "noise_range", check_noise_range(self.noise_range))
        check_options(self, ("epochs", "batch_size"))
        if self.loss not in LOSSES:
            raise ValueError(f"loss {self.loss!r}: choose one of {', '.join(LOSSES)}")


@dataclass(frozen=True, eq=False)
class TrainState:
    """A run after ``epoch`` finished epochs, on the CPU: the network's ``weights`` and the lowest-loss epoch's
    ``best`` (``state_dict`` entries), Adam's per-parameter ``optimizer`` state (parameter index -> {'step',
    'exp_avg', 'exp_avg_sq'}), the state of the generator of batches, steps and noise (``rng``, uint8) and each
    epoch's mean loss."""

    epoch: int
    weights: dict[str, torch.Tensor]
    best: dict[str, torch.Tensor]
    optimizer: dict[int, dict[str, torch.Tensor]]
    rng: torch.Tensor
    losses: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.epoch != len(self.losses):
            raise ValueError(f"a state after {self.epoch} epochs needs {self.epoch} losses, got {len(self.losses)}")


def _cpu(tensors: dict[Any, Any]) -> dict[Any, Any]:
    """A copy of a (nested) dict of tensors, on the CPU."""
    return {k: _cpu(v) if isinstance(v, dict) else v.detach().to("cpu", copy=True) for k, v in tensors.items()}


def _snapshot(
    epoch: int,
    model: UNet,
    best: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
    losses: list[float],
) -> TrainState:
    """The run after ``epoch`` epochs, copied to the CPU."""
    return TrainState(
        epoch,
        _cpu(model.state_dict()),
        _cpu(best),
        _cpu(optimizer.state_dict()["state"]),
        generator.get_state().clone(),
        tuple(losses),
    )


def _restore(state: TrainState, model: UNet, optimizer: torch.optim.Optimizer, generator: torch.Generator) -> None:
    """Put ``state``'s weights, Adam state and generator state into a freshly built run."""
    model.load_state_dict(state.weights)
    optimizer.load_state_dict({"state": state.optimizer, "param_groups": optimizer.state_dict()["param_groups"]})
    generator.set_state(state.rng)


def train_ddpm(
    images: torch.Tensor,
    config: UNetConfig,
    options: DDPMTrainOptions = DDPMTrainOptions(),
    progress: Callable[[EpochStats], None] | None = None,
    resume: TrainState | None = None,
    checkpoint: Callable[[TrainState], None] | None = None,
    checkpoint_every: int = 1,
    mask: torch.Tensor | None = None,
) -> tuple[UNet, list[float]]:
    """Train eps_theta on grids ``images`` (N, 1, S, S), already normalized, on their device; the conditional
    eps_theta when ``options.noise_range`` is set, its conditions noised on the entries of ``mask`` ((1, S, S)
    bool: the packing's real entries; all by default).

    ``resume``: go on from that state (same images, config and options but ``epochs``, which must be at least
    its epoch). ``checkpoint`` is called with the state after every ``checkpoint_every``-th epoch and after the
    last one. Returns the network of the lowest-loss epoch (eval mode, frozen) and every epoch's mean loss."""
    if images.dim() != 4 or images.shape[1] != 1 or images.shape[2] != images.shape[3]:
        raise ValueError(f"images must have shape (N, 1, S, S), got {tuple(images.shape)}")
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    if resume is not None and resume.epoch > options.epochs:
        raise ValueError(f"the run to resume has trained {resume.epoch} epochs, more than epochs={options.epochs}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(options.seed)
        model = UNet(config, images.shape[-1], options.noise_range is not None).to(images.device)
    generator = torch.Generator(device=images.device).manual_seed(options.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=options.lr)
    losses: list[float] = []
    best = None
    if resume is not None:
        _restore(resume, model, optimizer, generator)
        losses, best = list(resume.losses), resume.best
    for epoch in range(len(losses) + 1, options.epochs + 1):
        start, total = time.perf_counter(), torch.zeros((), device=images.device)
        order = torch.randperm(len(images), generator=generator, device=images.device)
        for batch in order.split(options.batch_size):
            loss = diffusion_loss(
                model, options.schedule, images[batch], generator, options.loss, options.noise_range, mask
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(batch)
        losses.append(float(total) / len(images))
        if best is None or losses[-1] < min(losses[:-1]):
            best = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        if progress is not None:
            progress(EpochStats(epoch, options.epochs, losses[-1], time.perf_counter() - start))
        if checkpoint is not None and (epoch % checkpoint_every == 0 or epoch == options.epochs):
            checkpoint(_snapshot(epoch, model, best, optimizer, generator, losses))
    assert best is not None  # the first epoch sets it
    model.load_state_dict(best)
    return model.eval().requires_grad_(False), losses
