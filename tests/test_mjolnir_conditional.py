"""Mjölnir (Condition): the conditional UNet, its training pairs, its chain, its file, its CLI and attack stage.

The mechanics are checked exactly (the condition as the second input channel, only the clean channel diffused,
the same draws replayed, the condition at every step of the chain, the file's kind); the evidence that it
denoises is a tiny conditional DDPM trained for seconds on grids of three fixed patterns with random
coefficients, which must bring M = 1 noise well below the noisy input's error.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from attackers.base import ATTACKS, build_attack
from attackers.diffusion import load_ddpm, save_ddpm
from attackers.diffusion.checkpoint import Checkpoint, check_resumable, grids_digest, options_from_dict, options_to_dict
from attackers.diffusion.condition import (
    DEFAULT_NOISE_RANGE,
    condition_of,
    draw_noise_levels,
    noisy_condition,
    parse_noise_range,
)
from attackers.diffusion.ddpm import DDPMTrainOptions, Schedule, diffusion_loss, q_sample, train_ddpm
from attackers.diffusion.denoise import denoise_many, start_step
from attackers.diffusion.packing import pack, unpack
from attackers.diffusion.pipeline import packing_of
from attackers.diffusion.store import TrainedDDPM
from attackers.diffusion.unet import UNet, UNetConfig
from attackers.mjolnir import Mjolnir, MjolnirParams
from fedguard.commands.cli import main
from fedguard.data import load_dataset
from fedguard.defenses import LocalStep, build_defense
from fedguard.defenses.dp_update import UpdateDPParams
from fedguard.models import build_model
from fedguard.models.mlp import MLPParams
from fedguard.training import compute_gradients, get_arrays, loss_fn
from tests.helpers import card_of

TINY = UNetConfig(base_channels=4, channel_mults=(1, 2), groups=2)
SCHEDULE = Schedule(steps=40, beta_end=0.2)
SMALL = ["data.name=digits", "model.name=mlp", "model.mlp.hidden=16", "train.batch-size=1"]


class Recorder(torch.nn.Module):
    """A conditional stand-in eps_theta: returns zeros and records x_t, t and the condition of every call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor, t: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        self.calls.append((x.clone(), t.clone(), condition.clone()))
        return torch.zeros_like(x)


def patterns(side: int = 16) -> torch.Tensor:
    """Three orthogonal unit-RMS patterns, (3, side * side) float64."""
    yy, xx = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    raw = torch.stack(
        [
            torch.sin(2 * math.pi * xx / side) * torch.cos(2 * math.pi * yy / side),
            torch.cos(4 * math.pi * (xx + yy) / side),
            ((xx // 4 + yy // 4) % 2).float() - 0.5,
        ]
    )
    q, _ = torch.linalg.qr(raw.reshape(3, -1).double().T)
    return q.T * side


def pattern_grids(n: int, seed: int, side: int = 16) -> torch.Tensor:
    """(n, 1, side, side) float32: the patterns with N(0, 1/3) coefficients (mean square 1)."""
    coefficients = torch.randn(n, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (coefficients / math.sqrt(3) @ patterns(side)).reshape(n, 1, side, side).float()


def tiny_conditional() -> tuple[UNet, list[float]]:
    """A conditional TINY UNet trained 2 epochs on 8 pattern grids of side 8, M in [0.5, 2]."""
    options = DDPMTrainOptions(epochs=2, batch_size=4, lr=1e-2, schedule=SCHEDULE, noise_range=(0.5, 2.0))
    return train_ddpm(pattern_grids(8, 0, side=8), TINY, options)


# --- the conditional UNet ---------------------------------------------------------------------------


def test_the_conditional_unet_takes_the_condition_as_a_second_channel() -> None:
    model = UNet(TINY, 8, conditional=True)
    assert model.conditional and model.init.weight.shape == (4, 2, 1, 1)
    assert UNet(TINY, 8).init.weight.shape == (4, 1, 1, 1) and not UNet(TINY, 8).conditional
    seen = []
    model.init.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
    x, c, t = torch.randn(3, 1, 8, 8), torch.randn(3, 1, 8, 8), torch.tensor([0, 5, 9])
    assert model(x, t, c).shape == (3, 1, 8, 8)
    assert torch.equal(seen[0], torch.cat([x, c], dim=1))
    with pytest.raises(ValueError, match=r"conditional: it needs condition grids of x's shape \(3, 1, 8, 8\), got N"):
        model(x, t)
    with pytest.raises(ValueError, match=r"got \(3, 1, 4, 4\)"):
        model(x, t, torch.zeros(3, 1, 4, 4))
    with pytest.raises(ValueError, match="this UNet is unconditional: it takes no condition grids"):
        UNet(TINY, 8)(x, t, c)


# --- training pairs ------------------------------------------------------------------------------------


def test_noise_levels_are_log_uniform_on_the_range_or_fixed() -> None:
    levels = draw_noise_levels((0.1, 10.0), 20_000, torch.Generator().manual_seed(0))
    assert levels.dtype == torch.float64 and float(levels.min()) >= 0.1 and float(levels.max()) <= 10.0
    logs = levels.log10()
    assert abs(float(logs.mean())) < 0.02 and float(logs.var()) == pytest.approx(4 / 12, rel=0.03)
    assert bool((draw_noise_levels((0.7, 0.7), 5, torch.Generator()) == 0.7).all())
    assert parse_noise_range("0.5,2") == (0.5, 2.0) and parse_noise_range("1") == (1.0, 1.0)
    assert DEFAULT_NOISE_RANGE == (0.01, 100.0)
    for bad in [(0.0, 1.0), (2.0, 1.0), (0.1, math.inf), (math.nan, 1.0)]:
        with pytest.raises(ValueError, match=r"0 < M_min <= M_max < inf, got \("):
            DDPMTrainOptions(noise_range=bad)
    with pytest.raises(ValueError, match=r"noise range must be \(M_min, M_max\), got \(1.0,\)"):
        DDPMTrainOptions(noise_range=(1.0,))
    with pytest.raises(ValueError, match=r"noise range '1,2,3': expected M or M_MIN,M_MAX"):
        parse_noise_range("1,2,3")


def test_training_diffuses_only_the_clean_channel_and_noises_the_condition_on_real_entries() -> None:
    x0 = pattern_grids(4, 1, side=8)
    mask = torch.ones(1, 8, 8, dtype=torch.bool)
    mask[0, 7] = False  # the last row is padding
    x0 = x0 * mask
    recorder = Recorder()
    diffusion_loss(recorder, SCHEDULE, x0, torch.Generator().manual_seed(3), noise_range=(0.2, 5.0), mask=mask)
    [(xt, t, condition)] = recorder.calls
    replay = torch.Generator().manual_seed(3)  # the same draws in the same order: step, diffusion noise, condition
    assert torch.equal(t, torch.randint(0, SCHEDULE.steps, (4,), generator=replay))
    noise = torch.randn(x0.shape, generator=replay)
    assert torch.equal(xt, q_sample(SCHEDULE, x0, t, noise))
    state = replay.get_state()
    assert torch.equal(condition, noisy_condition(x0, (0.2, 5.0), replay, mask))
    replay.set_state(state)
    levels = draw_noise_levels((0.2, 5.0), 4, replay)
    perturbation = torch.randn(x0.shape, generator=replay)
    m = levels.float().reshape(-1, 1, 1, 1)
    expected = (x0 + m * perturbation * mask) / (1 + m**2).sqrt()
    assert torch.allclose(condition, expected, atol=1e-6)
    assert bool((condition[..., 7, :] == 0).all()) and bool((xt[..., 7, :] != 0).all())
    assert torch.equal(condition_of(x0, torch.zeros(4, dtype=torch.float64)), x0)


def test_conditional_training_is_seeded_and_resumes_bit_for_bit_only_as_conditional() -> None:
    model, losses = tiny_conditional()
    again, same = tiny_conditional()
    assert model.conditional and losses == same and len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert all(torch.equal(t, again.state_dict()[n]) for n, t in model.state_dict().items())
    options = DDPMTrainOptions(epochs=2, batch_size=4, lr=1e-2, schedule=SCHEDULE, noise_range=[0.5, 2])
    assert options.noise_range == (0.5, 2.0)
    assert options_from_dict(json.loads(json.dumps(options_to_dict(options)))) == options
    states = []
    images = pattern_grids(8, 0, side=8)
    train_ddpm(images, TINY, options, checkpoint=states.append)
    longer = DDPMTrainOptions(epochs=3, batch_size=4, lr=1e-2, schedule=SCHEDULE, noise_range=(0.5, 2.0))
    whole, whole_losses = train_ddpm(images, TINY, longer)
    resumed, resumed_losses = train_ddpm(images, TINY, longer, resume=states[-1])  # the condition draws resume too
    assert resumed_losses == whole_losses
    assert all(torch.equal(t, resumed.state_dict()[n]) for n, t in whole.state_dict().items())
    checkpoint = Checkpoint(states[-1], TINY, 8, options, {}, grids_digest(images))
    unconditional = DDPMTrainOptions(epochs=2, batch_size=4, lr=1e-2, schedule=SCHEDULE)
    with pytest.raises(ValueError, match=r"DDPM noise_range: \(0.5, 2.0\) then, None now"):
        check_resumable(checkpoint, TINY, 8, unconditional, {}, grids_digest(images))


# --- the chain ----------------------------------------------------------------------------------------


def test_the_chain_gives_each_grid_its_rescaled_upload_as_condition_at_every_step() -> None:
    y = torch.randn(3, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    levels = [0.3, 1.2, 0.001]  # the last one starts nowhere and is passed on unchanged
    recorder = Recorder()
    out = denoise_many(recorder, SCHEDULE, y, levels, torch.Generator().manual_seed(1), conditional=True)
    starts = [start_step(SCHEDULE, m) for m in levels]
    assert starts[2] == -1 and starts[1] > starts[0] >= 0 and torch.equal(out[2], y[2])
    assert [int(t[0]) for _, t, _ in recorder.calls] == list(range(starts[1], -1, -1))
    rescaled = y / torch.tensor([math.sqrt(1 + m * m) for m in levels]).reshape(-1, 1, 1, 1)
    for _x, t, condition in recorder.calls:
        rows = [i for i, start in enumerate(starts) if start >= int(t[0])]
        assert torch.equal(condition, rescaled[rows])
    first_x, _, first_condition = recorder.calls[0]
    assert torch.equal(first_x, first_condition)  # the chain starts at t* from the condition itself
    with pytest.raises(ValueError, match="sampler 'single-step' is the released code's, for the unconditional"):
        denoise_many(recorder, SCHEDULE, y, levels, sampler="single-step", conditional=True)


# --- the file -------------------------------------------------------------------------------------------


def test_save_load_round_trip_keeps_the_kind_and_refuses_the_other(tmp_path: Path) -> None:
    model, losses = tiny_conditional()
    path = save_ddpm(TrainedDDPM(model, SCHEDULE, {"scale": 0.5}, tuple(losses), (0.5, 2.0)), tmp_path / "c.npz")
    loaded = load_ddpm(path)
    assert loaded.conditional and loaded.noise_range == (0.5, 2.0) and loaded.losses == tuple(losses)
    assert load_ddpm(path, conditional=True).conditional
    x, t, c = torch.randn(2, 1, 8, 8), torch.tensor([1, 30]), torch.randn(2, 1, 8, 8)
    assert torch.equal(model(x, t, c), loaded.model(x, t, c))
    with np.load(path, allow_pickle=False) as archive:
        meta = json.loads(str(archive["meta"]))
    assert meta["conditional"] is True and meta["noise_range"] == [0.5, 2.0]
    with pytest.raises(ValueError, match=r"c\.npz: its Mjölnir denoiser is conditional, expected unconditional"):
        load_ddpm(path, conditional=False)
    plain, plain_losses = train_ddpm(
        pattern_grids(8, 0, side=8), TINY, DDPMTrainOptions(epochs=1, batch_size=4, schedule=SCHEDULE)
    )
    plain_path = save_ddpm(TrainedDDPM(plain, SCHEDULE, {}, tuple(plain_losses)), tmp_path / "u.npz")
    with pytest.raises(
        ValueError,
        match=r"u\.npz: its Mjölnir denoiser is unconditional, expected conditional; "
        r"train one with `fedguard train-mjolnir --conditional`",
    ):
        load_ddpm(plain_path, conditional=True)
    with np.load(plain_path, allow_pickle=False) as archive:  # a file from before the conditional variant
        arrays = {name: archive[name] for name in archive.files}
    old = json.loads(str(arrays.pop("meta")))
    del old["conditional"], old["noise_range"]
    np.savez(tmp_path / "old.npz", meta=np.array(json.dumps(old)), **arrays)
    assert not load_ddpm(tmp_path / "old.npz", conditional=False).conditional
    with pytest.raises(ValueError, match=r"denoiser is conditional: noise_range must be \(M_min, M_max\), got None"):
        TrainedDDPM(model, SCHEDULE)
    with pytest.raises(ValueError, match=r"the denoiser is unconditional: noise_range must be None, got \(1, 2\)"):
        TrainedDDPM(plain, SCHEDULE, noise_range=(1, 2))


# --- train-mjolnir and the attack stage --------------------------------------------------------------


def upload(params: UpdateDPParams):
    """A batch-1 MLP upload of digit 0 under update-level DP of ``params``."""
    data = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("mlp", data.spec, MLPParams(hidden=16))
    card = card_of(model, "mlp", data.spec, {"hidden": 16, "depth": 2, "batch_norm": False})
    x, y = data.test.batch([0])
    grads, _ = compute_gradients(model, x, y)
    sent = build_defense("dp", params)(LocalStep(model, x, y, grads, loss_fn, torch.Generator().manual_seed(0)), {})
    return card.observe(1, 0, "gradient", get_arrays(model), [g.numpy() for g in sent], 1, {"batch-size": 1})


def test_train_mjolnir_conditional_and_the_attack_stage_that_reads_its_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "mjolnir" / "digits-mlp-conditional.npz"  # beside, not over, the unconditional default
    common = [
        "train-mjolnir",
        *(a for o in SMALL for a in ("--set", o)),
        "--gradients",
        "8",
        "--epochs",
        "1",
        "--checkpoint-every",
        "0",
    ]
    assert main([*common, "--conditional", "--noise-range", "0.5,2"]) == 0
    trained = load_ddpm(out)
    assert trained.conditional and trained.noise_range == (0.5, 2.0) and trained.normalization["model"] == "mlp"
    capsys.readouterr()
    assert main([*common, "--noise-range", "1", "--out", str(tmp_path / "x.npz")]) == 2
    assert "--noise-range 1 is for the conditional denoiser: add --conditional" in capsys.readouterr().err
    assert main([*common, "--conditional", "--noise-range", "2,0.5", "--out", str(tmp_path / "y.npz")]) == 2
    assert "0 < M_min <= M_max < inf, got (2.0, 0.5)" in capsys.readouterr().err
    assert main([*common, "--conditional", "--noise-range", "low", "--out", str(tmp_path / "z.npz")]) == 2
    assert "noise range 'low': expected M or M_MIN,M_MAX" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in ("x.npz", "y.npz", "z.npz"))

    params = UpdateDPParams(clip=100.0, noise_multiplier=0.01)
    obs = upload(params)
    attack = build_attack(
        "mjolnir+idlg", ATTACKS.get("mjolnir+idlg").params(denoiser=str(out), iterations=1, restarts=1), ("dp", params)
    )
    [denoised], [level], [start] = attack.denoised([obs])
    spec = packing_of(trained)
    assert level == pytest.approx(1.0 / spec.scale) and start == start_step(trained.schedule, level) >= 0
    grads = [torch.tensor(a) for a, t in zip(obs.upload, obs.trainable) if t]
    expected = denoise_many(
        trained.model,
        trained.schedule,
        pack(grads, spec).unsqueeze(0),
        [level],
        torch.Generator().manual_seed(0),
        conditional=True,
    )
    got = [a for a, t in zip(denoised.upload, denoised.trainable) if t]
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(got, unpack(expected[0], spec)))
    assert not np.array_equal(got[0], grads[0].numpy())
    with pytest.raises(ValueError, match=r"sampler 'single-step' .*conditional\.npz holds a conditional one"):
        Mjolnir(MjolnirParams(denoiser=str(out), sampler="single-step"), attack.inner)


# --- it denoises -------------------------------------------------------------------------------------------


def test_a_tiny_conditional_ddpm_denoises_pattern_grids_at_m_1(capsys: pytest.CaptureFixture[str]) -> None:
    schedule, m = Schedule(), 1.0
    images, clean = pattern_grids(256, 0), pattern_grids(32, 1)
    config = UNetConfig(base_channels=8, channel_mults=(1, 2, 2), groups=4)
    budget = dict(epochs=20, batch_size=32, lr=2e-3, seed=0, schedule=schedule)
    conditional, _ = train_ddpm(images, config, DDPMTrainOptions(**budget, noise_range=(0.5, 2.0)))
    unconditional, _ = train_ddpm(images, config, DDPMTrainOptions(**budget))
    noisy = clean + m * torch.randn(clean.shape, generator=torch.Generator().manual_seed(2))
    levels = [m] * len(clean)
    with_condition = denoise_many(
        conditional, schedule, noisy, levels, torch.Generator().manual_seed(3), conditional=True
    )
    without = denoise_many(unconditional, schedule, noisy, levels, torch.Generator().manual_seed(3))
    mse = {
        name: float((grids - clean).pow(2).mean())
        for name, grids in [
            ("noisy", noisy),
            ("rescaled", noisy / math.sqrt(1 + m * m)),
            ("conditional", with_condition),
            ("unconditional", without),
        ]
    }
    with capsys.disabled():
        print("\nMSE to the clean grids at M = 1: " + ", ".join(f"{k} {v:.4f}" for k, v in mse.items()))
    assert mse["conditional"] < mse["noisy"] and mse["conditional"] < 0.25 * mse["rescaled"]
