"""Mjölnir's gradient diffusion model: schedule, M-adaptive start step, chained reverse process, storage, noise levels.

The start step is checked against a brute-force nearest search and the notes' table of the released code's
choice; the rescaled noisy gradient against the forward marginal at that step by many draws; the reverse chain
by counting denoiser calls, by a hand-computed three-step example and by an oracle denoiser that must return
x0 exactly. The end-to-end evidence is a tiny DDPM trained for seconds on a toy distribution that must
denoise M = 0.5 Gaussian noise well below the noisy input's error.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from attackers.diffusion.checkpoint import Checkpoint, check_resumable, grids_digest, load_checkpoint, save_checkpoint
from attackers.diffusion.ddpm import DDPMTrainOptions, Schedule, TrainState, diffusion_loss, q_sample, train_ddpm
from attackers.diffusion.denoise import (
    _reverse_step,
    denoise,
    denoise_many,
    reverse_chain,
    reverse_coefficients,
    start_step,
    target_alpha_bar,
)
from attackers.diffusion.noise import (
    classical_gaussian_sigma,
    estimate_noise_level,
    noise_level,
    noise_level_dp,
    noise_level_epsilon,
    noise_level_from_c,
    noise_level_laplace,
)
from attackers.diffusion.store import TrainedDDPM, load_ddpm, save_ddpm
from attackers.diffusion.unet import UNet, UNetConfig, check_side, preset

SCHEDULE = Schedule()
TINY = UNetConfig(base_channels=4, channel_mults=(1, 2), groups=2)


class CountingDenoiser:
    """A stand-in eps_theta that returns ``value`` everywhere and records every step and input it is called with."""

    def __init__(self, value: float = 0.0) -> None:
        self.value, self.steps, self.inputs = value, [], []

    def __call__(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        assert t.shape == (len(x),) and bool((t == t[0]).all())
        self.steps.append(int(t[0]))
        self.inputs.append(x.clone())
        return torch.full_like(x, self.value)


def nearest_step(schedule: Schedule, m: float) -> int:
    """Brute force over the schedule in Python floats."""
    target = 1 / (1 + m * m)
    distances = [abs(a - target) for a in [1.0, *schedule.alpha_bars.tolist()]]
    return distances.index(min(distances)) - 1


def toy_grids(n: int, side: int, seed: int) -> torch.Tensor:
    """A fixed unit-RMS pattern times a random sign, (n, 1, side, side)."""
    yy, xx = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    pattern = torch.sin(4 * math.pi * xx / side) * torch.cos(2 * math.pi * yy / side) + 0.5 * ((xx + yy) % 3 == 0)
    pattern = (pattern - pattern.mean()) / (pattern - pattern.mean()).pow(2).mean().sqrt()
    signs = torch.randint(0, 2, (n, 1, 1, 1), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return (signs * pattern).float()


# --- schedule and forward process ---------------------------------------------------------------


def test_schedule_defaults_follow_the_released_code() -> None:
    assert SCHEDULE.steps == 1000
    assert SCHEDULE.betas[0].item() == pytest.approx(1e-4) and SCHEDULE.betas[-1].item() == pytest.approx(0.02)
    assert torch.allclose(SCHEDULE.alphas, 1 - SCHEDULE.betas)
    assert torch.allclose(SCHEDULE.alpha_bars, torch.cumprod(SCHEDULE.alphas, 0))
    assert SCHEDULE.alpha_bars[-1].item() == pytest.approx(4.04e-5, rel=0.01)
    assert bool((SCHEDULE.alpha_bars[1:] < SCHEDULE.alpha_bars[:-1]).all())
    assert len(Schedule(steps=7).betas) == 7


def test_q_sample_shapes_per_sample_steps_and_determinism() -> None:
    x0 = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0, 500, 999])
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    xt = q_sample(SCHEDULE, x0, t, noise)
    assert xt.shape == x0.shape and xt.dtype == x0.dtype
    again = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    assert torch.equal(q_sample(SCHEDULE, x0, t, again), xt)
    for i, k in enumerate(t.tolist()):
        abar = SCHEDULE.alpha_bars[k].item()
        assert torch.allclose(xt[i], math.sqrt(abar) * x0[i] + math.sqrt(1 - abar) * noise[i], atol=1e-6)
    silent = q_sample(SCHEDULE, x0, t, torch.zeros_like(x0))
    assert torch.allclose(silent[2], x0[2] * SCHEDULE.alpha_bars[999].sqrt().float())


def test_diffusion_loss_is_a_seeded_scalar() -> None:
    model = UNet(TINY, 8)
    x0 = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    first = diffusion_loss(model, SCHEDULE, x0, torch.Generator().manual_seed(3))
    second = diffusion_loss(model, SCHEDULE, x0, torch.Generator().manual_seed(3))
    assert first.shape == () and torch.equal(first, second)
    # The zero-initialized head predicts eps = 0, so the loss starts at E[eps**2] ~ 1.
    assert 0.5 < first.item() < 1.5
    huber = diffusion_loss(model, SCHEDULE, x0, torch.Generator().manual_seed(3), loss="huber")
    assert 0 < huber.item() < first.item()  # the same draws: 0.5 e**2 below 1, |e| - 0.5 above


# --- start step t* --------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [0.0, 1e-8, 1e-3, 0.05, 0.1, 0.5, 1.0, 2.0, 10.0, 100.0, 1e4, 1e8])
def test_start_step_is_the_nearest_alpha_bar(m: float) -> None:
    assert start_step(SCHEDULE, m) == nearest_step(SCHEDULE, m)
    assert target_alpha_bar(m) == pytest.approx(1 / (1 + m * m))


def test_start_step_edges() -> None:
    assert start_step(SCHEDULE, 0.0) == -1 and start_step(SCHEDULE, 1e-6) == -1 and start_step(SCHEDULE, 0.01) == 0
    boundary = math.sqrt(1 / (1 - SCHEDULE.betas[0].item() / 2) - 1)  # target halfway between 1 and alpha-bar 0
    assert start_step(SCHEDULE, boundary * 0.99) == -1 and start_step(SCHEDULE, boundary * 1.01) == 0
    assert start_step(SCHEDULE, 1e3) == SCHEDULE.steps - 1 and start_step(SCHEDULE, 1e8) == SCHEDULE.steps - 1
    assert start_step(Schedule(steps=1), 5.0) == 0


# Notes A.7: the released code's T' (1-based, first step with alpha-bar below 1/(1+M^2)); nearest is that or one before.
@pytest.mark.parametrize(
    ("m", "code_step"),
    [(0.01, 1), (0.05, 12), (0.1, 28), (0.2, 59), (0.5, 146), (1, 260), (2, 397), (3, 476), (5, 567), (10, 675)],
)
def test_start_step_against_the_notes_table(m: float, code_step: int) -> None:
    assert start_step(SCHEDULE, m) in (code_step - 2, code_step - 1)


def test_start_step_mismatch_is_within_half_the_schedule_gap() -> None:
    abar = SCHEDULE.alpha_bars
    for m in np.geomspace(0.02, 150, 300):
        k, target = start_step(SCHEDULE, float(m)), 1 / (1 + m * m)
        below = int((abar >= target).sum()) - 1  # last step at or above the target; the next one is below it
        assert 0 <= below < SCHEDULE.steps - 1
        gap = (abar[below] - abar[below + 1]).item()
        assert abs(abar[k].item() - target) <= gap / 2 + 1e-15
        # The gap is alpha_bars[k] * betas[k + 1]: at most 1e-4 near M = 0 and 0.02 * alpha-bar later on.
        assert gap == pytest.approx((abar[below] * SCHEDULE.betas[below + 1]).item())


# --- the rescaled noisy gradient is a forward marginal ------------------------------------------------


def _draws(x0: torch.Tensor, m: float, k: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` forward samples at step k and ``count`` rescaled noisy gradients, each (count, 1, S, S)."""
    batch = x0.expand(count, -1, -1, -1)
    eps = torch.randn(batch.shape, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    eps_dp = torch.randn(batch.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    forward = q_sample(SCHEDULE, batch, torch.full((count,), k), eps)
    rescaled = (batch + m * eps_dp) / math.sqrt(1 + m * m)
    return forward, rescaled


@pytest.mark.parametrize("exact", [True, False])
def test_rescaled_noisy_gradient_matches_the_forward_marginal(exact: bool) -> None:
    x0 = torch.randn(1, 1, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    if exact:
        k = 200
        m = math.sqrt(1 / SCHEDULE.alpha_bars[k].item() - 1)
    else:
        m = 0.5
        k = start_step(SCHEDULE, m)
    assert start_step(SCHEDULE, m) == k
    abar, target, count = SCHEDULE.alpha_bars[k].item(), 1 / (1 + m * m), 20_000
    # Deterministic bound on the mean and std mismatch from the discrete schedule (0 when exact).
    gap = abs(abar - target)
    mean_gap = gap / (math.sqrt(abar) + math.sqrt(target))
    std_gap = gap / (math.sqrt(1 - abar) + math.sqrt(1 - target))
    if exact:
        assert gap < 1e-12
    else:
        assert gap <= (SCHEDULE.alpha_bars[k] * SCHEDULE.betas[k + 1]).item()
    assert abs(math.sqrt(abar) - 1 / math.sqrt(1 + m * m)) <= mean_gap + 1e-12
    assert abs(math.sqrt(1 - abar) - m / math.sqrt(1 + m * m)) <= std_gap + 1e-12
    forward, rescaled = _draws(x0, m, k, count)
    sigma = math.sqrt(1 - target)
    mean_tolerance = 5 * sigma / math.sqrt(count) * math.sqrt(2)  # difference of two sample means, 5 sigma
    std_tolerance = 5 * sigma / math.sqrt(2 * count) * math.sqrt(2)
    mean_difference = (forward.mean(0) - rescaled.mean(0)).abs()
    std_difference = (forward.std(0) - rescaled.std(0)).abs()
    assert bool((mean_difference <= mean_tolerance + mean_gap * x0[0].abs()).all())
    assert bool((std_difference <= std_tolerance + std_gap).all())
    assert torch.allclose(rescaled.mean(0), x0[0] / math.sqrt(1 + m * m), atol=mean_tolerance)
    assert torch.allclose(rescaled.std(0), torch.full_like(x0[0], sigma), atol=std_tolerance)


# --- reverse chain -------------------------------------------------------------------------------------


@pytest.mark.parametrize("start", [0, 1, 5, 49])
def test_reverse_chain_calls_the_denoiser_at_every_step_down_to_zero(start: int) -> None:
    schedule, model = Schedule(steps=50), CountingDenoiser()
    x = torch.zeros(3, 1, 4, 4)
    out = reverse_chain(model, schedule, x, start, torch.Generator().manual_seed(0))
    assert model.steps == list(range(start, -1, -1))
    assert out.shape == x.shape


def test_denoise_starts_at_t_star_from_the_rescaled_input_and_runs_to_zero() -> None:
    model = CountingDenoiser()
    y = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    denoise(model, SCHEDULE, y, 0.5)
    assert model.steps == list(range(start_step(SCHEDULE, 0.5), -1, -1)) and len(model.steps) == 145
    assert torch.allclose(model.inputs[0], y / math.sqrt(1.25))
    assert all(not torch.equal(a, b) for a, b in zip(model.inputs, model.inputs[1:]))


def test_a_noise_level_nearer_the_clean_end_than_step_zero_denoises_nothing() -> None:
    model = CountingDenoiser()
    y = torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    for m in (0.0, 0.005):
        assert torch.equal(denoise(model, SCHEDULE, y, m), y)
    assert model.steps == []


@pytest.mark.parametrize("variance", ["beta", "posterior"])
def test_reverse_chain_hand_example(variance: str) -> None:
    # betas 0.1, 0.2, 0.3; alphas 0.9, 0.8, 0.7; alpha-bars 0.9, 0.72, 0.504; eps_theta = 0.5 everywhere.
    schedule, model = Schedule(steps=3, beta_start=0.1, beta_end=0.3), CountingDenoiser(0.5)
    x2 = torch.tensor([[[[1.0, -2.0]]]], dtype=torch.float64)
    draws = torch.Generator().manual_seed(7)
    z2, z1 = (torch.randn(x2.shape, generator=draws, dtype=torch.float64) for _ in range(2))
    if variance == "beta":
        s2, s1 = math.sqrt(0.3), math.sqrt(0.2)
    else:
        s2, s1 = math.sqrt(0.3 * 0.28 / 0.496), math.sqrt(0.2 * 0.1 / 0.28)
    x1 = (x2 - 0.3 / math.sqrt(0.496) * 0.5) / math.sqrt(0.7) + s2 * z2
    x0 = (x1 - 0.2 / math.sqrt(0.28) * 0.5) / math.sqrt(0.8) + s1 * z1
    expected = (x0 - 0.1 / math.sqrt(0.1) * 0.5) / math.sqrt(0.9)
    out = reverse_chain(model, schedule, x2, 2, torch.Generator().manual_seed(7), variance)
    assert model.steps == [2, 1, 0]
    assert torch.allclose(out, expected, atol=1e-12)


def test_each_step_mean_is_the_posterior_mean_of_the_predicted_x0() -> None:
    # Eq. 11 in the standard form, with x0_hat the x0 implied by eps:
    # mu = sqrt(abar_{k-1}) beta_k / (1 - abar_k) x0_hat + sqrt(alpha_k) (1 - abar_{k-1}) / (1 - abar_k) x_k.
    schedule = Schedule(steps=3, beta_start=0.1, beta_end=0.3)
    coefficient, inverse_sqrt_alpha, _ = reverse_coefficients(schedule)
    xk, eps = 1.3, 0.5
    for k in (1, 2):
        beta, alpha = schedule.betas[k].item(), schedule.alphas[k].item()
        abar, previous = schedule.alpha_bars[k].item(), schedule.alpha_bars[k - 1].item()
        x0_hat = (xk - math.sqrt(1 - abar) * eps) / math.sqrt(abar)
        mu = math.sqrt(previous) * beta / (1 - abar) * x0_hat + math.sqrt(alpha) * (1 - previous) / (1 - abar) * xk
        assert (xk - coefficient[k] * eps) * inverse_sqrt_alpha[k] == pytest.approx(mu, abs=1e-12)


@pytest.mark.parametrize("variance", ["beta", "posterior"])
def test_an_oracle_denoiser_recovers_x0(variance: str) -> None:
    x0 = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    abar = SCHEDULE.alpha_bars

    def oracle(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a = abar[t].view(-1, 1, 1, 1)
        return (x - a.sqrt() * x0) / (1 - a).sqrt()

    y = x0 + 0.7 * torch.randn(x0.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert torch.allclose(denoise(oracle, SCHEDULE, y, 0.7, variance=variance), x0, atol=1e-9)


def test_one_batched_chain_with_one_noise_level_equals_denoise() -> None:
    def model(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * t.view(-1, 1, 1, 1).to(x.dtype) / 1000

    y = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    alone = denoise(model, SCHEDULE, y, 0.8, torch.Generator().manual_seed(4))
    batched = denoise_many(model, SCHEDULE, y, [0.8, 0.8, 0.8], torch.Generator().manual_seed(4))
    assert torch.equal(alone, batched)


def test_each_grid_joins_the_batched_chain_at_its_own_start_step() -> None:
    model = CountingDenoiser()
    levels = [0.5, 0.1, 0.0, 0.5]
    y = torch.randn(4, 1, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out = denoise_many(model, SCHEDULE, y, levels)
    starts = [start_step(SCHEDULE, m) for m in levels]
    assert starts[2] == -1 and torch.equal(out[2], y[2])  # noiseless: never in the chain
    assert model.steps == list(range(max(starts), -1, -1))
    assert [len(x) for x in model.inputs] == [sum(s >= k for s in starts) for k in model.steps]
    joined = model.inputs[model.steps.index(starts[1])]  # the M = 0.1 grid enters rescaled at its start step
    assert torch.allclose(joined[1], y[1] / math.sqrt(1.01))  # chain rows follow the grids: 0, 1, 3
    assert torch.allclose(model.inputs[0], y[[0, 3]] / math.sqrt(1.25))


def test_an_oracle_denoiser_recovers_every_grid_at_its_own_noise_level() -> None:
    x0 = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    abar = SCHEDULE.alpha_bars
    rows = []

    def oracle(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a = abar[t].view(-1, 1, 1, 1)
        return (x - a.sqrt() * x0[rows[-1]]) / (1 - a).sqrt()

    levels = [0.7, 0.2, 1.5]
    starts = [start_step(SCHEDULE, m) for m in levels]

    def tracking(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        rows.append([i for i, s in enumerate(starts) if s >= int(t[0])])
        return oracle(x, t)

    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = x0 + torch.tensor(levels, dtype=torch.float64).view(-1, 1, 1, 1) * noise
    assert torch.allclose(denoise_many(tracking, SCHEDULE, y, levels), x0, atol=1e-9)


def _smooth_denoiser(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A deterministic stand-in eps_theta that depends on the input and the step."""
    return torch.tanh(x) * (t.view(-1, 1, 1, 1).to(x.dtype) + 1) / 100


def test_the_single_step_sampler_is_one_ancestral_step_zero_on_each_rescaled_grid() -> None:
    levels = [0.5, 2.0, 0.0]  # start steps 145, 396 and -1: every grid takes the one step, as the released code does
    y = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rescaled = y / torch.tensor([math.sqrt(1.25), math.sqrt(5.0), 1.0], dtype=torch.float64).view(-1, 1, 1, 1)
    out = denoise_many(_smooth_denoiser, SCHEDULE, y, levels, sampler="single-step")
    step = _reverse_step(_smooth_denoiser, rescaled, 0, reverse_coefficients(SCHEDULE), torch.Generator())
    assert torch.equal(out, step)
    beta, abar = SCHEDULE.betas[0].item(), SCHEDULE.alpha_bars[0].item()  # the code's t = 1: no noise is added
    by_hand = (rescaled - beta / math.sqrt(1 - abar) * _smooth_denoiser(rescaled, torch.zeros(3))) / math.sqrt(1 - beta)
    assert torch.allclose(out, by_hand, atol=1e-15)
    assert not torch.equal(out[2], y[2])  # M = 0 is stepped too
    posterior = denoise_many(
        _smooth_denoiser, SCHEDULE, y, levels, torch.Generator().manual_seed(9), "posterior", "single-step"
    )
    assert torch.equal(posterior, out)  # neither the variance nor the generator enters step 0
    model = CountingDenoiser(0.5)
    denoise_many(model, SCHEDULE, y, levels, sampler="single-step")
    assert model.steps == [0] and torch.equal(model.inputs[0], rescaled)


def test_the_single_step_sampler_differs_from_the_chain() -> None:
    y = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    chained = denoise_many(_smooth_denoiser, SCHEDULE, y, [0.5, 0.5])
    single = denoise_many(_smooth_denoiser, SCHEDULE, y, [0.5, 0.5], sampler="single-step")
    assert torch.equal(chained, denoise(_smooth_denoiser, SCHEDULE, y, 0.5))
    assert (chained - single).abs().max().item() > 0.1
    with pytest.raises(ValueError, match="sampler 'loop': choose one of chained, single-step"):
        denoise_many(_smooth_denoiser, SCHEDULE, y, [0.5, 0.5], sampler="loop")


def test_batched_denoising_needs_one_level_per_grid() -> None:
    with pytest.raises(ValueError, match="2 noise levels for 3 grids"):
        denoise_many(CountingDenoiser(), SCHEDULE, torch.zeros(3, 1, 4, 4), [0.1, 0.2])


def test_denoise_is_seeded_and_keeps_the_batch_shape() -> None:
    model = UNet(TINY, 8)
    torch.nn.init.normal_(model.head.weight, std=0.1)
    y = torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    schedule = Schedule(steps=40, beta_start=1e-3, beta_end=0.2)
    first = denoise(model, schedule, y, 1.0)
    assert first.shape == y.shape and torch.equal(first, denoise(model, schedule, y, 1.0))
    other = denoise(model, schedule, y, 1.0, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(first, other)


# --- UNet -------------------------------------------------------------------------------------------


def test_unet_shapes_presets_and_zero_start() -> None:
    model = UNet(TINY, 8)
    x, t = torch.randn(3, 1, 8, 8), torch.tensor([0, 10, 999])
    assert model(x, t).shape == x.shape
    assert torch.equal(model(x, t), torch.zeros_like(x))
    cpu, gpu = preset("cpu"), preset("gpu")
    assert (cpu.levels, cpu.widths, cpu.mid_attention) == (2, (16, 32, 32), False)
    assert (gpu.levels, gpu.widths, gpu.blocks_per_level, gpu.mid_attention) == (2, (120, 240, 480), 2, True)
    assert sum(p.numel() for p in UNet(cpu, 32).parameters()) < 300_000
    attention = UNetConfig(4, (1, 2), groups=2, mid_attention=True, heads=2, head_channels=4)
    assert UNet(attention, 4)(torch.randn(2, 1, 4, 4), torch.tensor([3, 4])).shape == (2, 1, 4, 4)


def test_unet_side_must_be_a_multiple_of_two_to_the_levels() -> None:
    check_side(preset("cpu"), 120)
    with pytest.raises(ValueError, match=r"S=126.*multiple of 4.*124 or 128"):
        UNet(preset("cpu"), 126)
    with pytest.raises(ValueError, match=r"S=2.*multiple of 4.*nearest: 4\)"):
        check_side(preset("cpu"), 2)
    with pytest.raises(ValueError, match=r"\(N, 1, 8, 8\), got \(2, 1, 16, 16\)"):
        UNet(TINY, 8)(torch.zeros(2, 1, 16, 16), torch.zeros(2, dtype=torch.long))


# --- training and storage ----------------------------------------------------------------------------


def test_training_is_seeded_and_keeps_the_lowest_loss_epoch() -> None:
    images = toy_grids(16, 8, seed=0)
    options = DDPMTrainOptions(epochs=4, batch_size=8, lr=3e-3, seed=5, schedule=Schedule(steps=50, beta_end=0.2))
    seen = []
    model, losses = train_ddpm(images, TINY, options, progress=seen.append)
    again, same = train_ddpm(images, TINY, options)
    assert losses == same and len(losses) == 4 and [e.epoch for e in seen] == [1, 2, 3, 4]
    assert [e.loss for e in seen] == losses and all(math.isfinite(v) for v in losses)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    best = int(np.argmin(losses)) + 1
    truncated = DDPMTrainOptions(epochs=best, batch_size=8, lr=3e-3, seed=5, schedule=options.schedule)
    kept, _ = train_ddpm(images, TINY, truncated)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, kept.state_dict()[name]) and torch.equal(tensor, again.state_dict()[name])


def _same_state(a: TrainState, b: TrainState) -> bool:
    """Equal epochs, losses, weights, lowest-loss weights, Adam state and generator state, bit for bit."""
    tensors = [(a.weights, b.weights), (a.best, b.best)]
    tensors += [(a.optimizer[i], b.optimizer[i]) for i in a.optimizer]
    return (
        (a.epoch, a.losses, sorted(a.optimizer)) == (b.epoch, b.losses, sorted(b.optimizer))
        and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in tensors)
        and torch.equal(a.rng, b.rng)
    )


def test_training_in_two_sittings_equals_one_bit_for_bit(tmp_path) -> None:
    images = toy_grids(6, 8, seed=2)
    schedule = Schedule(steps=50, beta_end=0.2)
    options = DDPMTrainOptions(epochs=4, batch_size=4, lr=3e-3, seed=5, schedule=schedule)
    whole: list[TrainState] = []
    model, losses = train_ddpm(images, TINY, options, checkpoint=whole.append)
    assert [s.epoch for s in whole] == [1, 2, 3, 4] and len(whole[0].optimizer) == len(list(model.parameters()))
    first: list[TrainState] = []
    train_ddpm(
        images,
        TINY,
        DDPMTrainOptions(epochs=2, batch_size=4, lr=3e-3, seed=5, schedule=schedule),
        checkpoint=first.append,
        checkpoint_every=2,
    )
    assert [s.epoch for s in first] == [2] and _same_state(first[0], whole[1])
    checkpoint = Checkpoint(first[0], TINY, 8, options, {"scale": 0.25}, grids_digest(images))
    path = save_checkpoint(checkpoint, tmp_path / "c.npz")
    loaded = load_checkpoint(path)
    assert _same_state(loaded.state, first[0]) and loaded.config == TINY and loaded.options == options
    assert loaded.record == {"scale": 0.25} and loaded.digest == grids_digest(images) and loaded.side == 8
    second: list[TrainState] = []
    resumed, resumed_losses = train_ddpm(images, TINY, options, resume=loaded.state, checkpoint=second.append)
    assert resumed_losses == losses and [s.epoch for s in second] == [3, 4]
    assert _same_state(second[-1], whole[-1])
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name])
    done, again = train_ddpm(images, TINY, options, resume=whole[-1])  # nothing left to train: the best epoch
    assert again == losses and all(torch.equal(t, done.state_dict()[n]) for n, t in model.state_dict().items())
    with pytest.raises(ValueError, match="has trained 4 epochs, more than epochs=3"):
        train_ddpm(images, TINY, DDPMTrainOptions(epochs=3, schedule=schedule), resume=whole[-1])


def test_a_checkpoint_is_written_every_n_epochs_and_after_the_last() -> None:
    seen: list[TrainState] = []
    options = DDPMTrainOptions(epochs=5, batch_size=4, schedule=Schedule(steps=10))
    train_ddpm(toy_grids(4, 8, seed=0), TINY, options, checkpoint=seen.append, checkpoint_every=2)
    assert [s.epoch for s in seen] == [2, 4, 5]
    with pytest.raises(ValueError, match="checkpoint_every must be >= 1, got 0"):
        train_ddpm(toy_grids(4, 8, seed=0), TINY, options, checkpoint=seen.append, checkpoint_every=0)


def test_a_checkpoint_resumes_only_the_same_run(tmp_path) -> None:
    images = toy_grids(4, 8, seed=0)
    options = DDPMTrainOptions(epochs=2, batch_size=4, schedule=Schedule(steps=10))
    states: list[TrainState] = []
    train_ddpm(images, TINY, options, checkpoint=states.append)
    record = {"packing": {"side": 8, "scale": 0.5, "shapes": [[64]]}, "model": "mlp"}
    checkpoint = Checkpoint(states[-1], TINY, 8, options, record, grids_digest(images))
    check_resumable(
        checkpoint,
        TINY,
        8,
        DDPMTrainOptions(epochs=9, batch_size=4, schedule=Schedule(steps=10)),
        record,
        grids_digest(images),
    )
    with pytest.raises(ValueError, match=r"DDPM lr: 0.0001 then, 0.001 now; .*trained 2 epochs, more than epochs=1"):
        fewer = DDPMTrainOptions(epochs=1, batch_size=4, lr=1e-3, schedule=Schedule(steps=10))
        check_resumable(checkpoint, TINY, 8, fewer, record, grids_digest(images))
    with pytest.raises(ValueError, match="the training gradients differ from those it trained on"):
        check_resumable(checkpoint, TINY, 8, options, record, grids_digest(images * 2))
    with pytest.raises(ValueError, match=r"training gradients' model: 'mlp' then, 'lenet' now"):
        check_resumable(checkpoint, TINY, 8, options, {**record, "model": "lenet"}, grids_digest(images * 2))
    with pytest.raises(ValueError, match=r"UNet .* on side 8 then, .* on side 16 now"):
        check_resumable(checkpoint, TINY, 16, options, record, grids_digest(images))
    with pytest.raises(FileNotFoundError, match=r"no Mjölnir training checkpoint at .*none\.npz"):
        load_checkpoint(tmp_path / "none.npz")
    np.savez(tmp_path / "other.npz", meta=np.array(json.dumps({"format": "x"})), rng=np.zeros(1, np.uint8))
    with pytest.raises(ValueError, match="format 'x', expected 'fedguard-mjolnir-checkpoint/1'"):
        load_checkpoint(tmp_path / "other.npz")


def test_save_load_round_trip_is_exact(tmp_path) -> None:
    images = toy_grids(8, 8, seed=1)
    schedule = Schedule(steps=30, beta_start=1e-3, beta_end=0.1)
    model, losses = train_ddpm(images, TINY, DDPMTrainOptions(epochs=2, batch_size=4, lr=1e-2, schedule=schedule))
    normalization = {"scale": 0.0123, "signal_power": 1.0, "layers": [3, 4]}
    path = save_ddpm(TrainedDDPM(model, schedule, normalization, tuple(losses)), tmp_path / "sub" / "mj.npz")
    assert path.is_file() and not (tmp_path / "sub" / ".mj.npz.part").exists()
    loaded = load_ddpm(path)
    assert loaded.schedule == schedule and loaded.normalization == normalization and loaded.losses == tuple(losses)
    assert loaded.model.config == TINY and loaded.model.side == 8
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.model.state_dict()[name])
    x, t = torch.randn(3, 1, 8, 8), torch.tensor([0, 7, 29])
    assert torch.equal(model(x, t), loaded.model(x, t))
    assert torch.equal(denoise(model, schedule, x, 0.3), denoise(loaded.model, loaded.schedule, x, 0.3))
    with np.load(path, allow_pickle=False) as archive:
        meta = json.loads(str(archive["meta"]))
    assert meta["side"] == 8 and meta["unet"]["channel_mults"] == [1, 2] and meta["schedule"]["steps"] == 30


def test_load_errors(tmp_path) -> None:
    missing = tmp_path / "nowhere.npz"
    with pytest.raises(FileNotFoundError, match=r"nowhere\.npz.*`fedguard train-mjolnir`"):
        load_ddpm(missing)
    other = tmp_path / "other.npz"
    np.savez(other, meta=np.array(json.dumps({"format": "something-else"})))
    with pytest.raises(ValueError, match="something-else"):
        load_ddpm(other)


def test_a_tiny_trained_ddpm_denoises_a_toy_distribution() -> None:
    schedule = Schedule()
    images = toy_grids(256, 16, seed=0)
    config = UNetConfig(base_channels=8, channel_mults=(1, 2, 2), groups=4)
    options = DDPMTrainOptions(epochs=10, batch_size=32, lr=2e-3, seed=0, schedule=schedule)
    model, losses = train_ddpm(images, config, options)
    assert losses[-1] < 0.5 * losses[0]
    clean = toy_grids(16, 16, seed=1)
    m = 0.5
    noisy = clean + m * torch.randn(clean.shape, generator=torch.Generator().manual_seed(2))
    denoised = denoise(model, schedule, noisy, m)
    noisy_mse = (noisy - clean).pow(2).mean().item()
    rescaled_mse = (noisy / math.sqrt(1 + m * m) - clean).pow(2).mean().item()
    denoised_mse = (denoised - clean).pow(2).mean().item()
    assert denoised_mse < 0.5 * noisy_mse and denoised_mse < 0.5 * rescaled_mse


# --- noise levels ------------------------------------------------------------------------------------


def test_noise_levels_against_hand_values() -> None:
    assert noise_level(0.3) == pytest.approx(0.3) and noise_level(0.3, scale=2.0) == pytest.approx(0.15)
    assert noise_level_dp(0.5, 2.0, scale=4.0) == pytest.approx(0.25)
    assert classical_gaussian_sigma(1.0, 1e-5, 1.0) == pytest.approx(4.8448, abs=1e-4)
    assert classical_gaussian_sigma(1.0, 1e-4, 1.0) == pytest.approx(4.3436, abs=1e-4)
    # Notes A.7: sensitivity 0.02 (2 * lr * C / m with lr 1e-3, C 10, m 1), delta 1e-5.
    assert noise_level_epsilon(1.0, 1e-5, 0.02) == pytest.approx(0.0969, abs=1e-4)
    assert noise_level_epsilon(0.5, 1e-5, 0.02) == pytest.approx(0.1938, abs=1e-4)
    assert noise_level_epsilon(1.0, 1e-5, 0.02, scale=0.01) == pytest.approx(9.69, abs=1e-2)
    assert noise_level_laplace(0.02) == pytest.approx(0.02 * math.sqrt(2))
    assert noise_level_laplace(1.0, scale=math.sqrt(2)) == pytest.approx(1.0)
    assert noise_level_from_c(1.0) == 0.0 and noise_level_from_c(1 / math.sqrt(2)) == pytest.approx(1.0)
    assert noise_level_from_c(0.99) == pytest.approx(math.sqrt(1 / 0.99**2 - 1))


def test_estimated_noise_level() -> None:
    generator = torch.Generator().manual_seed(0)
    clean = torch.randn(8, 1, 32, 32, generator=generator)
    noisy = clean + 0.5 * torch.randn(clean.shape, generator=generator)
    assert estimate_noise_level(noisy, signal_power=1.0) == pytest.approx(0.5, abs=0.03)
    assert estimate_noise_level(clean * 0.9, signal_power=1.0) == 0.0
    padded = torch.zeros(8, 1, 40, 40)
    padded[..., :32, :32] = noisy
    mask = torch.zeros(1, 1, 40, 40, dtype=torch.bool)
    mask[..., :32, :32] = True
    assert estimate_noise_level(padded, 1.0, mask) == pytest.approx(estimate_noise_level(noisy, 1.0), rel=1e-9)


# --- validation ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: Schedule(steps=0), r"steps must be >= 1, got 0"),
        (lambda: Schedule(beta_start=0.0), r"0 < beta_start <= beta_end < 1, got beta_start=0.0"),
        (lambda: Schedule(beta_end=1.0), r"0 < beta_start <= beta_end < 1, got .*beta_end=1.0"),
        (lambda: DDPMTrainOptions(lr=0.0), r"lr must be > 0, got 0.0"),
        (lambda: DDPMTrainOptions(batch_size=0), r"batch_size must be >= 1, got 0"),
        (lambda: DDPMTrainOptions(loss="l1"), r"loss 'l1': choose one of mse, huber"),
        (
            lambda: diffusion_loss(UNet(TINY, 8), SCHEDULE, torch.zeros(1, 1, 8, 8), torch.Generator(), "l1"),
            r"loss 'l1': choose one of mse, huber",
        ),
        (lambda: UNetConfig(groups=3), r"width 16 is not a multiple of groups=3"),
        (lambda: UNetConfig(channel_mults=()), r"channel_mults must be a non-empty .* got \(\)"),
        (lambda: preset("tpu"), r"preset 'tpu': choose one of cpu, gpu"),
        (lambda: train_ddpm(torch.zeros(2, 3, 8, 8), TINY), r"\(N, 1, S, S\), got \(2, 3, 8, 8\)"),
        (lambda: start_step(SCHEDULE, -0.1), r"noise level M must be finite and >= 0, got -0.1"),
        (lambda: start_step(SCHEDULE, math.inf), r"noise level M must be finite and >= 0, got inf"),
        (
            lambda: reverse_chain(
                CountingDenoiser(), Schedule(steps=50), torch.zeros(1, 1, 4, 4), 50, torch.Generator()
            ),
            r"start step 50 is outside the schedule's steps 0..49",
        ),
        (lambda: reverse_coefficients(SCHEDULE, "fixed"), r"variance 'fixed': choose one of beta, posterior"),
        (lambda: noise_level(-1.0), r"noise std must be finite and >= 0, got -1.0"),
        (lambda: noise_level(1.0, scale=0.0), r"scale must be finite and > 0, got 0.0"),
        (lambda: noise_level_dp(-0.5, 1.0), r"noise multiplier must be finite and >= 0, got -0.5"),
        (lambda: noise_level_dp(0.5, 0.0), r"clip must be finite and > 0, got 0.0"),
        (lambda: classical_gaussian_sigma(0.0, 1e-5, 1.0), r"epsilon must be finite and > 0, got 0.0"),
        (lambda: classical_gaussian_sigma(1.0, 1.5, 1.0), r"delta must be in \(0, 1\), got 1.5"),
        (lambda: classical_gaussian_sigma(1.0, 1e-5, -2.0), r"sensitivity must be finite and >= 0, got -2.0"),
        (lambda: noise_level_laplace(math.nan), r"Laplace scale b must be finite and >= 0, got nan"),
        (lambda: noise_level_from_c(0.0), r"c must be in \(0, 1\], got 0.0"),
        (lambda: estimate_noise_level(torch.zeros(1, 1, 4, 4), -1.0), r"signal power must be .* >= 0, got -1.0"),
    ],
)
def test_parameter_validation(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
