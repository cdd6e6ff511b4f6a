"""The evaluation network D of Refiner: it learns the noise ratio, its file round-trips, its command works."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from fedguard.commands.cli import build_parser, main
from fedguard.data import DataSpec, load_dataset
from fedguard.defenses.evalnet import (
    EvalNet,
    EvalNetOptions,
    TrainedEvalNet,
    blend,
    load_evalnet,
    save_evalnet,
    train_evalnet,
    train_regressor,
)
from tests.helpers import rewrite_meta

SMALL = EvalNetOptions(epochs=5, width=8)
UNIFORM_VARIANCE = 1 / 12  # MSE of always predicting the mean ratio 0.5


@pytest.fixture(scope="module")
def trained() -> TrainedEvalNet:
    return train_evalnet("photos", "test", SMALL)


def test_blend_mixes_each_image_with_uniform_noise_at_its_ratio() -> None:
    images = torch.rand(5, 3, 4, 4)
    mixed, ratios = blend(images, torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(1)
    r, noise = torch.rand(5, generator=generator), torch.rand(images.shape, generator=generator)
    assert torch.equal(ratios, r)
    assert torch.allclose(mixed, (1 - r.reshape(-1, 1, 1, 1)) * images + r.reshape(-1, 1, 1, 1) * noise)
    assert mixed.min() >= 0 and mixed.max() <= 1


def test_network_regresses_the_noise_ratio_of_held_out_images(trained: TrainedEvalNet) -> None:
    """Trained on the photo tiles of the test split; scored on tiles of the train split it never saw."""
    held_out, _ = load_dataset("photos").train.batch(np.arange(0, 800, 4))
    with torch.no_grad():
        mixed, ratios = blend(held_out, torch.Generator().manual_seed(7))
        mse = float((trained.net(mixed) - ratios).pow(2).mean())
        levels = [
            float(trained.net((1 - r) * held_out + r * torch.rand(held_out.shape)).mean())
            for r in (0.0, 0.25, 0.5, 0.75, 1.0)
        ]
    print("held-out ratio mse", mse, "mean D at ratios 0..1", levels, "training losses", trained.losses)
    assert mse < UNIFORM_VARIANCE / 8, mse
    assert all(a < b for a, b in itertools.pairwise(levels)), levels
    assert levels[0] < 0.2 and levels[-1] > 0.8, levels
    assert trained.losses[-1] < trained.losses[0]


def test_output_shape_range_and_architecture() -> None:
    net = EvalNet(DataSpec(3, 32, 32, 10), 128)
    assert sum(p.numel() for p in net.parameters()) == 1_487_105  # the paper's D at 32x32 (Appendix D)
    out = EvalNet(DataSpec(1, 28, 28, 10), 4)(torch.rand(3, 1, 28, 28))
    assert out.shape == (3,) and (out > 0).all() and (out < 1).all()
    with pytest.raises(ValueError, match="width must be >= 1, got 0"):
        EvalNet(DataSpec(1, 8, 8, 10), 0)


def test_save_load_round_trip_is_exact(trained: TrainedEvalNet, tmp_path: Path) -> None:
    path = save_evalnet(trained, tmp_path / "sub" / "d.npz")
    loaded = load_evalnet(path)
    assert loaded.meta() == trained.meta()
    assert loaded.meta()["spec"] == [3, 32, 32, 10] and loaded.meta()["epochs"] == SMALL.epochs
    for (name, a), (other, b) in zip(trained.net.state_dict().items(), loaded.net.state_dict().items()):
        assert name == other and torch.equal(a, b)
    x = torch.rand(4, 3, 32, 32)
    assert torch.equal(trained.net(x), loaded.net(x))
    assert not loaded.net.training and not any(p.requires_grad for p in loaded.net.parameters())
    with np.load(path, allow_pickle=False) as archive:  # plain arrays only: loads without pickle
        assert set(archive.files) == {"meta", *(f"net/{n}" for n in trained.net.state_dict())}


def test_training_is_deterministic_given_the_seed() -> None:
    images = torch.rand(8, 1, 8, 8)
    options = EvalNetOptions(epochs=1, width=2, mixes=2, batch_size=4, seed=3)
    first, losses = train_regressor(images, DataSpec(1, 8, 8, 10), options)
    second, again = train_regressor(images, DataSpec(1, 8, 8, 10), options)
    assert losses == again
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    with pytest.raises(ValueError, match=r"shape \(1, 8, 8\) do not match the spec's \(3, 8, 8\)"):
        train_regressor(images, DataSpec(3, 8, 8, 10), options)


def test_missing_mismatched_and_other_shape_files_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"none\.npz.*fedguard train-evalnet --data <dataset>"):
        load_evalnet(tmp_path / "none.npz")
    small = TrainedEvalNet(EvalNet(DataSpec(1, 8, 8, 10), 2), "digits", "test", (0.1,))
    path = save_evalnet(small, tmp_path / "d.npz")
    with pytest.raises(
        ValueError,
        match=r"d\.npz was trained on images of shape \(1, 8, 8\) \(digits\), but these "
        r"images have shape \(3, 32, 32\).*fedguard train-evalnet --data <dataset>",
    ):
        load_evalnet(path).check_shape((3, 32, 32), path)
    load_evalnet(path).check_shape((1, 8, 8), path)
    rewrite_meta(path, width=3)
    with pytest.raises(ValueError, match=r"d\.npz: network arrays .* do not match its meta"):
        load_evalnet(path)
    rewrite_meta(path, format="fedguard-generator/1")
    with pytest.raises(ValueError, match="'fedguard-generator/1', expected 'fedguard-evalnet/1'"):
        load_evalnet(path)
    np.savez(tmp_path / "plain.npz", a=np.zeros(2))
    with pytest.raises(ValueError, match="not an evaluation-network file"):
        load_evalnet(tmp_path / "plain.npz")


def test_options_are_validated() -> None:
    for field in ("epochs", "batch_size", "width", "mixes"):
        with pytest.raises(ValueError, match=f"{field} must be >= 1, got 0"):
            EvalNetOptions(**{field: 0})
    with pytest.raises(ValueError, match="lr must be > 0"):
        EvalNetOptions(lr=0.0)
    with pytest.raises(ValueError, match="split 'all': choose one of test, train"):
        train_evalnet("digits", "all")


def test_command_trains_and_writes_a_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    defaults = build_parser().parse_args(["train-evalnet"])
    assert (defaults.data, defaults.split, defaults.out) == ("photos", "test", None)
    monkeypatch.chdir(tmp_path)
    assert main(["train-evalnet", "--data", "digits", "--epochs", "2", "--width", "2", "--mixes", "2"]) == 0
    out = capsys.readouterr().out
    assert "epoch 1/2: ratio mse" in out and "epoch 2/2: ratio mse" in out and "saved evalnets/digits.npz" in out
    meta = load_evalnet(tmp_path / "evalnets" / "digits.npz").meta()
    assert (meta["dataset"], meta["split"], meta["epochs"], meta["width"], meta["spec"]) == (
        "digits",
        "test",
        2,
        2,
        [1, 8, 8, 10],
    )


def test_command_rejects_a_bad_dataset_or_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d.npz"
    assert main(["train-evalnet", "--data", "nope", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "photos" in err
    assert main(["train-evalnet", "--data", "digits", "--mixes", "0", "--out", str(out)]) == 2
    assert "mixes must be >= 1, got 0" in capsys.readouterr().err
    assert not out.exists()
