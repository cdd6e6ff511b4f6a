"""The generator (a VAE decoder), its file format and command, and the generative-prior attack 'ggl'.

The attacker trains its generator on mnist-5k's test split, which clients
never train on, then attacks MLP FedSGD gradients of train-split digits. The
floor is a flat image of the true mean intensity (about 8-11 dB PSNR and 0.01
SSIM on these digits); latent search of the generator must beat it widely.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from attackers.base import build_attack
from attackers.engine.terms import latent_kl
from attackers.generative import GenerativeAttack, GenerativeParams
from attackers.generators import (
    Decoder,
    TrainedGenerator,
    TrainOptions,
    load_generator,
    save_generator,
    train_generator,
    train_vae,
)
from fedguard.commands.cli import main
from fedguard.data import DataSpec, load_dataset
from fedguard.metrics import psnr, ssim
from fedguard.metrics.matching import match
from fedguard.observation import Observation
from fedguard.training import compute_gradients
from tests.devices import ATTACK_DEVICE
from tests.helpers import rewrite_meta
from tests.untrained import untrained_mlp

DIGITS = [0, 7, 100, 2000, 3000, 3999]  # train-split digits: the clients' data
SMALL = TrainOptions(epochs=3, batch_size=32, latent_dim=8, width=8)


def small_images(count: int = 256) -> tuple[torch.Tensor, DataSpec]:
    data = load_dataset("mnist-5k")
    return data.test.batch(np.arange(count))[0], data.spec


def uploads(batch: int) -> tuple[list[Observation], list[torch.Tensor], list[torch.Tensor]]:
    """One FedSGD upload per ``batch`` consecutive entries of DIGITS, from one MLP; the true images and labels."""
    data, model, arrays, card = untrained_mlp("mnist-5k")
    observations, images, labels = [], [], []
    for start in range(0, len(DIGITS), batch):
        x, y = data.train.batch(DIGITS[start : start + batch])
        grads, _ = compute_gradients(model, x, y)
        observations.append(
            card.observe(1, start, "gradient", arrays, [g.numpy() for g in grads], batch, {"batch-size": batch})
        )
        images.append(x)
        labels.append(y)
    return observations, images, labels


def scores(recon: torch.Tensor, truth: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """PSNR and SSIM of each true image against its matched reconstruction."""
    paired = recon[torch.as_tensor(match(recon, truth, metric="mse"))]
    return psnr(paired, truth).numpy(), ssim(paired, truth).numpy()


def floor(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    flat = x.mean((2, 3), keepdim=True).expand_as(x)
    return psnr(flat, x).numpy(), ssim(flat, x).numpy()


@pytest.fixture(scope="module")
def generator_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generator trained on mnist-5k's held-out test split (1,000 digits, 20 epochs)."""
    trained = train_generator("mnist-5k", "test", TrainOptions(epochs=20))
    return save_generator(trained, tmp_path_factory.mktemp("generators") / "mnist-5k.npz")


def attack(generator: Path, **params) -> GenerativeAttack:
    return GenerativeAttack(GenerativeParams(generator=str(generator), device=ATTACK_DEVICE, **params))


def test_training_lowers_the_loss_and_is_deterministic() -> None:
    images, spec = small_images()
    lines = []
    decoder, losses = train_vae(images, spec, SMALL, progress=lambda stats: lines.append(str(stats)))
    again, _ = train_vae(images, spec, SMALL)
    other, _ = train_vae(images, spec, TrainOptions(**{**SMALL.__dict__, "seed": 1}))
    assert losses[-1] < losses[0] - 50, losses
    assert len(lines) == 3 and lines[-1].startswith("epoch 3/3: loss ") and lines[-1].endswith(" s")
    z = torch.randn(4, SMALL.latent_dim)
    out = decoder(z)
    assert out.shape == (4, *spec.shape) and float(out.min()) >= 0 and float(out.max()) <= 1
    assert torch.equal(out, again(z)) and not torch.equal(out, other(z))


def test_save_and_load_round_trip_exactly(tmp_path: Path) -> None:
    images, spec = small_images(64)
    decoder, losses = train_vae(images, spec, TrainOptions(epochs=1, latent_dim=8, width=8))
    path = save_generator(TrainedGenerator(decoder, "mnist-5k", "test", tuple(losses)), tmp_path / "sub" / "g.npz")
    loaded = load_generator(path)
    z = torch.randn(3, 8)
    assert torch.equal(loaded.decoder(z), decoder(z))
    assert loaded.meta() == TrainedGenerator(decoder, "mnist-5k", "test", tuple(losses)).meta()
    assert (
        loaded.meta()["epochs"] == 1
        and loaded.meta()["loss"] == losses[-1]
        and loaded.meta()["spec"] == [1, 28, 28, 10]
    )
    assert [p.name for p in path.parent.iterdir()] == ["g.npz"], "no partial file may remain"


def test_missing_and_mismatched_files_give_clear_errors(tmp_path: Path) -> None:
    missing = tmp_path / "none.npz"
    with pytest.raises(FileNotFoundError, match=r"none\.npz.*fedguard train-generator"):
        load_generator(missing)
    path = save_generator(
        TrainedGenerator(Decoder(DataSpec(1, 8, 8, 10), 4, 4), "digits", "test", (1.0,)), tmp_path / "g.npz"
    )
    rewrite_meta(path, latent_dim=5)
    with pytest.raises(ValueError, match=r"g\.npz: decoder arrays .* do not match its meta"):
        load_generator(path)
    rewrite_meta(path, format="other/9")
    with pytest.raises(ValueError, match="'other/9', expected 'fedguard-generator/1'"):
        load_generator(path)


def test_command_trains_and_writes_a_generator(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train-generator", "--data", "digits", "--epochs", "2", "--latent-dim", "4", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "epoch 1/2: loss" in out and "epoch 2/2: loss" in out and "saved generators/digits.npz" in out
    loaded = load_generator(tmp_path / "generators" / "digits.npz")
    meta = loaded.meta()
    assert (meta["dataset"], meta["split"], meta["epochs"], meta["latent_dim"]) == ("digits", "test", 2, 4)
    assert meta["spec"] == [1, 8, 8, 10]


def test_command_rejects_a_bad_dataset_or_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "g.npz"
    assert main(["train-generator", "--data", "nope", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "mnist-5k" in err and "digits" in err
    assert main(["train-generator", "--data", "digits", "--epochs", "0", "--out", str(out)]) == 2
    assert "epochs must be >= 1, got 0" in capsys.readouterr().err
    assert not out.exists()


def test_attack_needs_a_generator_file_and_valid_params(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a generator.*fedguard train-generator"):
        build_attack("ggl")
    with pytest.raises(FileNotFoundError, match=r"absent\.npz.*fedguard train-generator"):
        build_attack("ggl", GenerativeParams(generator=str(tmp_path / "absent.npz")))
    with pytest.raises(ValueError, match="'l1': choose one of cosine, l2"):
        GenerativeParams(distance="l1")
    with pytest.raises(ValueError, match="kl must be >= 0"):
        GenerativeParams(kl=-1.0)
    path = save_generator(
        TrainedGenerator(Decoder(DataSpec(1, 28, 28, 10), 4, 4), "mnist-5k", "test", (1.0,)), tmp_path / "g.npz"
    )
    built = build_attack("ggl", GenerativeParams(generator=str(path)))
    assert (built.needs, built.uploads, built.manipulation) == (frozenset(), frozenset({"gradient"}), "none")


def test_attack_rejects_a_generator_of_another_shape_and_weight_uploads(tmp_path: Path) -> None:
    observations, _, _ = uploads(1)
    small = save_generator(
        TrainedGenerator(Decoder(DataSpec(1, 8, 8, 10), 4, 4), "digits", "test", (1.0,)), tmp_path / "digits.npz"
    )
    with pytest.raises(ValueError, match=r"shape \(1, 8, 8\).*shape \(1, 28, 28\).*fedguard train-generator"):
        attack(small, iterations=1).reconstruct_many([observations[0]], 0)[0]
    fitting = save_generator(
        TrainedGenerator(Decoder(DataSpec(1, 28, 28, 10), 4, 4), "mnist-5k", "test", (1.0,)), tmp_path / "mnist.npz"
    )
    weights = Observation(**{**observations[0].__dict__, "kind": "weights"})
    with pytest.raises(ValueError, match="needs FedSGD gradients"):
        attack(fitting, iterations=1).reconstruct_many([weights], 0)[0]


def test_latent_prior_is_zero_for_standardized_latents() -> None:
    z = torch.tensor([[[1.0, -1.0, 1.0, -1.0]], [[3.0, 3.0, 5.0, 5.0]]])
    assert torch.allclose(latent_kl(z), torch.tensor([0.0, 0.5 * (1 + 16 - 1)]))


def test_generator_prior_reconstructs_single_digits(generator_file: Path) -> None:
    observations, images, labels = uploads(1)
    recons = attack(generator_file, iterations=150, restarts=2).reconstruct_many(observations[:3], 0)
    x = torch.cat(images[:3])
    got_psnr, got_ssim = scores(torch.cat([r.images for r in recons]), x)
    floor_psnr, floor_ssim = floor(x)
    print("GGL batch 1 psnr", got_psnr, "ssim", got_ssim, "floor", floor_psnr, floor_ssim)
    assert (got_psnr > floor_psnr + 5).all() and got_psnr.mean() > floor_psnr.mean() + 7, (got_psnr, floor_psnr)
    assert (got_ssim > floor_ssim + 0.5).all(), (got_ssim, floor_ssim)
    assert [int(r.labels[0]) for r in recons] == [int(y[0]) for y in labels[:3]]
    assert all(r.stats["labels_inferred"] and r.stats["batched_jobs"] == 6 for r in recons)


def test_generator_prior_reconstructs_pairs_of_digits(generator_file: Path) -> None:
    observations, images, labels = uploads(2)
    recons = attack(generator_file, iterations=150, restarts=2).reconstruct_many(observations[:2], 0)
    for rec, x, y in zip(recons, images, labels):
        got_psnr, got_ssim = scores(rec.images, x)
        floor_psnr, floor_ssim = floor(x)
        print("GGL batch 2 psnr", got_psnr, "ssim", got_ssim, "floor", floor_psnr, floor_ssim)
        assert got_psnr.mean() > floor_psnr.mean() + 5 and got_ssim.mean() > floor_ssim.mean() + 0.4
        assert sorted(rec.labels.tolist()) == sorted(y.tolist())


def test_batched_restarts_equal_one_at_a_time(generator_file: Path) -> None:
    observations, _, _ = uploads(1)
    ggl = attack(generator_file, iterations=20, restarts=2)
    together = ggl.reconstruct_many(observations[:2], seed=5)
    alone = [ggl.reconstruct_many([obs], seed=5)[0] for obs in observations[:2]]
    for a, b in zip(together, alone):
        assert torch.allclose(a.images, b.images, atol=1e-5)
        assert np.allclose(a.stats["restart_losses"], b.stats["restart_losses"], atol=1e-5)
        assert a.stats["loss"] == min(a.stats["restart_losses"])
