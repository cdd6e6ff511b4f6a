"""Mjölnir as a stage of the attacks: fedguard train-mjolnir, mjolnir+<attack>, the noise level it denoises at."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from attackers.base import ATTACKS, build_attack, check_attack_files
from attackers.diffusion import denoise_many, load_checkpoint, load_ddpm, load_gradient_set, start_step
from attackers.diffusion.packing import pack, unpack
from attackers.diffusion.pipeline import packing_of
from attackers.mjolnir import INNER_ATTACKS, Mjolnir, MjolnirParams, defense_noise_std
from fedguard.commands.cli import main
from fedguard.config import ConfigError, load_config
from fedguard.data import load_dataset
from fedguard.defenses import LocalStep, build_defense
from fedguard.defenses.dp_sgd import DPSGDParams
from fedguard.defenses.dp_update import UpdateDPParams, mjolnir_code_sigma
from fedguard.evaluation import gradient_scores
from fedguard.models import build_model
from fedguard.models.mlp import MLPParams
from fedguard.runtime.server_app import initial_model
from fedguard.store.observation_files import save_observation
from fedguard.training import compute_gradients, get_arrays, loss_fn, set_arrays
from tests.helpers import card_of, needs_fashion_mnist

SMALL = ["data.name=digits", "model.name=mlp", "model.mlp.hidden=16", "train.batch-size=1"]


@pytest.fixture(scope="module")
def denoiser(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mjolnir") / "digits-mlp.npz"
    args = [
        "train-mjolnir",
        *(a for o in SMALL for a in ("--set", o)),
        "--gradients",
        "32",
        "--epochs",
        "2",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    return out


def upload(defense: str = "none", params=None, image: int = 0):
    data = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("mlp", data.spec, MLPParams(hidden=16))
    card = card_of(model, "mlp", data.spec, {"hidden": 16, "depth": 2, "batch_norm": False})
    x, y = data.test.batch([image])
    grads, _ = compute_gradients(model, x, y)
    sent = build_defense(defense, params)(LocalStep(model, x, y, grads, loss_fn, torch.Generator().manual_seed(0)), {})
    return card.observe(1, 0, "gradient", get_arrays(model), [g.numpy() for g in sent], 1, {"batch-size": 1}), grads


def test_train_mjolnir_records_what_the_model_denoises(denoiser: Path) -> None:
    trained = load_ddpm(denoiser)
    record = trained.normalization
    assert record["model"] == "mlp" and record["model_params"]["hidden"] == 16 and record["batch_size"] == 1
    assert record["dataset"] == "digits" and record["split"] == "test" and record["signal_power"] > 0
    assert record["packing"]["side"] % 8 == 0 and len(trained.losses) == 2
    gradients = load_gradient_set(denoiser.with_suffix(".gradients.npz"))
    assert gradients.images.shape == (32, 1, record["packing"]["side"], record["packing"]["side"])
    assert gradients.spec.scale == record["packing"]["scale"] and gradients.batch_size == 1


def test_a_zero_surrogate_lr_records_gradients_at_the_runs_first_global_model(tmp_path: Path) -> None:
    out = tmp_path / "at-start.npz"
    args = [
        "train-mjolnir",
        *(a for o in [*SMALL, "seed=7"] for a in ("--set", o)),
        "--gradients",
        "4",
        "--surrogate-epochs",
        "1",
        "--surrogate-lr",
        "0",
        "--epochs",
        "1",
        "--out",
        str(out),
    ]
    assert main(args) == 0
    gradients = load_gradient_set(out.with_suffix(".gradients.npz"))
    assert gradients.options.seed == 7 and gradients.options.lr == 0.0
    global_model = initial_model(load_config(None, [*SMALL, "seed=7"]))
    data = load_dataset("digits")
    for image, batch in zip(gradients.images, gradients.batches):
        expected = compute_gradients(global_model, *data.test.batch(batch))[0]
        assert all(torch.equal(a, b) for a, b in zip(unpack(image, gradients.spec), expected))


def test_the_surrogate_can_start_at_a_captured_rounds_global_model(tmp_path: Path) -> None:
    obs, _ = upload()
    later = dataclasses.replace(obs, round=5, global_arrays=[a * 0.5 for a in obs.global_arrays])
    path = save_observation(later, tmp_path / "observations")
    out = tmp_path / "at-round-5.npz"
    args = [
        "train-mjolnir",
        *(a for o in SMALL for a in ("--set", o)),
        "--gradients",
        "3",
        "--surrogate-epochs",
        "1",
        "--surrogate-lr",
        "0",
        "--epochs",
        "1",
        "--at",
        str(path),
        "--out",
        str(out),
    ]
    assert main(args) == 0
    gradients = load_gradient_set(out.with_suffix(".gradients.npz"))
    assert gradients.start == "weights" and load_ddpm(out).normalization["start"] == "weights"
    model = build_model("mlp", load_dataset("digits").spec, MLPParams(hidden=16))
    set_arrays(model, later.global_arrays)
    data = load_dataset("digits")
    for image, batch in zip(gradients.images, gradients.batches):
        expected = compute_gradients(model, *data.test.batch(batch))[0]
        assert all(torch.equal(a, b) for a, b in zip(unpack(image, gradients.spec), expected))
    other = [*(a for o in [*SMALL, "model.mlp.hidden=32"] for a in ("--set", o)), "--at", str(path)]
    assert main(["train-mjolnir", *other, "--out", str(tmp_path / "x.npz")]) == 2
    assert (
        main(
            [
                "train-mjolnir",
                *(a for o in SMALL for a in ("--set", o)),
                "--at",
                str(tmp_path / "none.npz"),
                "--out",
                str(tmp_path / "y.npz"),
            ]
        )
        == 2
    )


@needs_fashion_mnist
def test_the_surrogate_can_learn_on_another_dataset_of_the_runs_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The paper's setting: Fashion-MNIST gradients, at the run's round-1 global model, to denoise MNIST uploads.
    run = ["data.name=mnist-5k", "model.name=mlp", "model.mlp.hidden=16", "train.batch-size=1"]
    common = [
        "train-mjolnir",
        *(a for o in run for a in ("--set", o)),
        "--gradients",
        "3",
        "--surrogate-epochs",
        "1",
        "--surrogate-lr",
        "0",
        "--epochs",
        "1",
        "--checkpoint-every",
        "0",
    ]
    monkeypatch.chdir(tmp_path)
    assert main([*common, "--surrogate-data", "fashion-mnist"]) == 0
    out = tmp_path / "mjolnir" / "fashion-mnist-mlp.npz"  # named after the data its gradients come from
    assert load_ddpm(out).normalization["dataset"] == "fashion-mnist"
    gradients = load_gradient_set(out.with_suffix(".gradients.npz"))
    assert gradients.dataset == "fashion-mnist" and gradients.start == "seed"
    global_model = initial_model(load_config(None, run))
    data = load_dataset("fashion-mnist")
    for image, batch in zip(gradients.images, gradients.batches):
        expected = compute_gradients(global_model, *data.test.batch(batch))[0]
        assert all(torch.equal(a, b) for a, b in zip(unpack(image, gradients.spec), expected))
    capsys.readouterr()
    assert main([*common, "--surrogate-data", "digits"]) == 2  # 1x8x8 digits: the MLP's first layer would differ
    error = capsys.readouterr().err
    assert "'digits' has 1x8x8 images with 10 classes" in error and "'mnist-5k' 1x28x28 images" in error
    assert not (tmp_path / "mjolnir" / "digits-mlp.npz").exists()


def test_train_mjolnir_in_two_sittings_saves_the_model_of_one(tmp_path: Path) -> None:
    common = [
        *(a for o in SMALL for a in ("--set", o)),
        "--gradients",
        "4",
        "--surrogate-epochs",
        "1",
        "--ddpm-batch-size",
        "2",
    ]
    assert main(["train-mjolnir", *common, "--epochs", "4", "--out", str(tmp_path / "one.npz")]) == 0
    assert (
        main(["train-mjolnir", *common, "--epochs", "2", "--checkpoint-every", "2", "--out", str(tmp_path / "two.npz")])
        == 0
    )
    checkpoint = tmp_path / "two.checkpoint.npz"
    assert load_checkpoint(checkpoint).state.epoch == 2
    assert (
        main(
            ["train-mjolnir", *common, "--epochs", "4", "--resume", str(checkpoint), "--out", str(tmp_path / "two.npz")]
        )
        == 0
    )
    one, two = load_ddpm(tmp_path / "one.npz"), load_ddpm(tmp_path / "two.npz")
    assert one.losses == two.losses and len(two.losses) == 4 and one.normalization == two.normalization
    for name, tensor in one.model.state_dict().items():
        assert torch.equal(tensor, two.model.state_dict()[name])
    assert load_checkpoint(checkpoint).state.epoch == 4
    other = ["train-mjolnir", *common, "--epochs", "6", "--resume", str(checkpoint), "--out", str(tmp_path / "x.npz")]
    assert main([*other, "--lr", "0.01"]) == 2  # another DDPM step: refused
    assert main([*other, "--gradients", "3"]) == 2  # other training gradients: refused
    assert (
        main(
            ["train-mjolnir", *common, "--epochs", "1", "--checkpoint-every", "0", "--out", str(tmp_path / "none.npz")]
        )
        == 0
    )
    assert not (tmp_path / "none.checkpoint.npz").exists()


def test_every_optimization_attack_has_a_mjolnir_stage_with_its_own_parameters() -> None:
    for inner in INNER_ATTACKS:
        fields = set(ATTACKS.get(f"mjolnir+{inner}").params.__dataclass_fields__)
        assert {"denoiser", "noise_source", "noise_std"} <= fields
        assert set(ATTACKS.get(inner).params.__dataclass_fields__) <= fields
    own, inner = ATTACKS.get("mjolnir+ig").params(denoiser="m.npz", iterations=7).split()
    assert own == MjolnirParams(denoiser="m.npz") and inner.iterations == 7


def test_noise_level_comes_from_the_known_defense_in_packed_units(denoiser: Path) -> None:
    dp = build_defense("dp", UpdateDPParams(clip=2.0, noise_multiplier=0.05))
    assert defense_noise_std(dp, 4) == pytest.approx(0.1)
    laplace = build_defense("dp", UpdateDPParams(clip=1.0, noise_multiplier=0.1, mechanism="laplace"))
    assert defense_noise_std(laplace, 1) == pytest.approx(0.1 * np.sqrt(2))
    assert defense_noise_std(build_defense("dp-sgd", DPSGDParams(clip=1.0, noise_multiplier=2.0)), 8) == 0.25
    with pytest.raises(ValueError, match="adds none it models"):
        defense_noise_std(build_defense("dgp"), 1)

    params = UpdateDPParams(clip=10.0, noise_multiplier=0.001)
    obs, _ = upload("dp", params)
    attack = build_attack(
        "mjolnir+idlg",
        ATTACKS.get("mjolnir+idlg").params(denoiser=str(denoiser), iterations=5, restarts=1),
        ("dp", params),
    )
    [denoised], [level], [start] = attack.denoised([obs])
    scale = load_ddpm(denoiser).normalization["packing"]["scale"]
    assert level == pytest.approx(0.01 / scale) and start == start_step(attack.trained.schedule, level)
    assert [a.shape for a in denoised.upload] == [a.shape for a in obs.upload]
    assert not np.array_equal(denoised.upload[0], obs.upload[0])  # the gradient was denoised
    [result] = attack.reconstruct_many([obs], 0)
    assert result.stats["mjolnir_noise_level"] == level and result.images.shape == (1, 1, 8, 8)
    assert [g.shape for g in result.gradient] == [a.shape for a, t in zip(obs.upload, obs.trainable) if t]


def test_a_known_noiseless_upload_is_passed_on_unchanged(denoiser: Path) -> None:
    params = UpdateDPParams(clip=100.0, noise_multiplier=0.0)
    obs, _ = upload("dp", params)
    attack = build_attack(
        "mjolnir+idlg",
        ATTACKS.get("mjolnir+idlg").params(denoiser=str(denoiser), iterations=5, restarts=1),
        ("dp", params),
    )
    [denoised], [level], [start] = attack.denoised([obs])
    assert level == 0.0 and start == -1
    assert all(np.array_equal(a, b) for a, b in zip(denoised.upload, obs.upload))


def test_the_mjolnir_code_calibration_is_the_known_noise_std(denoiser: Path) -> None:
    for clip in (0.5, 40.0):
        params = UpdateDPParams(clip=clip, epsilon=1.0, delta=1e-4, calibration="mjolnir-code")
        assert defense_noise_std(build_defense("dp", params), 1) == mjolnir_code_sigma(1.0, 1e-4)
    obs, _ = upload("dp", params)
    attack = build_attack(
        "mjolnir+idlg",
        ATTACKS.get("mjolnir+idlg").params(denoiser=str(denoiser), iterations=5, restarts=1),
        ("dp", params),
    )
    [_], [level], _ = attack.denoised([obs])
    assert level == mjolnir_code_sigma(1.0, 1e-4) / load_ddpm(denoiser).normalization["packing"]["scale"]


def test_the_single_step_sampler_takes_each_upload_through_the_released_codes_step(denoiser: Path) -> None:
    params = UpdateDPParams(clip=10.0, noise_multiplier=0.001)
    obs, _ = upload("dp", params)
    uploads = {}
    for sampler in ("chained", "single-step"):
        attack = build_attack(
            "mjolnir+idlg",
            ATTACKS.get("mjolnir+idlg").params(denoiser=str(denoiser), iterations=5, restarts=1, sampler=sampler),
            ("dp", params),
        )
        [uploads[sampler]], [level], _ = attack.denoised([obs])
    trained = load_ddpm(denoiser)
    spec = packing_of(trained)
    grads = [torch.tensor(a) for a, t in zip(obs.upload, obs.trainable) if t]
    expected = unpack(
        denoise_many(trained.model, trained.schedule, pack(grads, spec).unsqueeze(0), [level], sampler="single-step")[
            0
        ],
        spec,
    )
    got = [a for a, t in zip(uploads["single-step"].upload, uploads["single-step"].trainable) if t]
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(got, expected))
    assert not np.array_equal(uploads["single-step"].upload[0], uploads["chained"].upload[0])
    with pytest.raises(ValueError, match="sampler 'loop': choose one of chained, single-step"):
        MjolnirParams(sampler="loop")


def test_mjolnir_with_nothing_to_denoise_is_its_inner_attack_on_the_same_upload(denoiser: Path) -> None:
    # The pairing `idlg` / `mjolnir+idlg` in one run is the identity baseline: the same upload, parameters and seeds.
    params = UpdateDPParams(clip=100.0, noise_multiplier=0.0)
    obs, _ = upload("dp", params)
    plain = build_attack("idlg", ATTACKS.get("idlg").params(iterations=5, restarts=2))
    staged = build_attack(
        "mjolnir+idlg",
        ATTACKS.get("mjolnir+idlg").params(denoiser=str(denoiser), iterations=5, restarts=2),
        ("dp", params),
    )
    [alone], [after] = plain.reconstruct_many([obs], 0), staged.reconstruct_many([obs], 0)
    assert torch.equal(alone.images, after.images) and torch.equal(alone.labels, after.labels)
    assert alone.stats["restart_losses"] == after.stats["restart_losses"]
    assert after.stats["mjolnir_start_step"] == -1


def test_a_denoiser_for_another_model_is_refused(denoiser: Path) -> None:
    data = load_dataset("digits")
    model = build_model("mlp", data.spec, MLPParams(hidden=8))
    card = card_of(model, "mlp", data.spec, {"hidden": 8, "depth": 2, "batch_norm": False})
    x, y = data.test.batch([0])
    grads, _ = compute_gradients(model, x, y)
    obs = card.observe(1, 0, "gradient", get_arrays(model), [g.numpy() for g in grads], 1, {"batch-size": 1})
    attack = Mjolnir(
        MjolnirParams(denoiser=str(denoiser), noise_source="given", noise_std=0.01),
        build_attack("idlg", ATTACKS.get("idlg").params(iterations=2, restarts=1)),
    )
    with pytest.raises(ValueError, match="denoises gradients of 'mlp'.*train-mjolnir"):
        attack.reconstruct_many([obs], 0)


def test_configuration_needs_the_defense_grant_and_a_denoiser(denoiser: Path) -> None:
    """The configuration checks that a denoiser is set; the server checks that it is there, before round 1."""
    base = [*SMALL, "attack.name=mjolnir+ig", "defense.name=dp", "capture.rounds=1"]
    with pytest.raises(ConfigError, match="defense"):
        load_config(None, [*base, f"attack.mjolnir+ig.denoiser={denoiser}"])
    with pytest.raises(ConfigError, match="Mjölnir needs a diffusion model"):
        load_config(None, [*base, "threat.defense=true"])
    absent = load_config(None, [*base, "threat.defense=true", "attack.mjolnir+ig.denoiser=missing.npz"])
    missing = re.escape(str(Path.cwd() / "missing.npz"))  # resolved where the configuration was loaded
    with pytest.raises(
        FileNotFoundError, match=f"attack.mjolnir\\+ig.denoiser = '{missing}': no Mjölnir diffusion model at {missing}"
    ):
        check_attack_files(absent.attacks)
    config = load_config(None, [*base, "threat.defense=true", f"attack.mjolnir+ig.denoiser={denoiser}"])
    assert config.attack_names() == ["mjolnir+ig"]
    check_attack_files(config.attacks)
    with pytest.raises(ValueError, match="noise-source 'given' needs noise-std > 0"):
        MjolnirParams(noise_source="given")
    with pytest.raises(ValueError, match="noise-source 'guess': choose one of defense, given, estimate"):
        MjolnirParams(noise_source="guess")


def test_the_evaluator_scores_the_denoised_gradient_against_the_clean_one() -> None:
    obs, clean = upload("dp", UpdateDPParams(clip=10.0, noise_multiplier=0.01))
    x, y = load_dataset("digits").test.batch([0])
    scores = gradient_scores(obs, [g.numpy() for g in clean], x, y)
    assert scores["cosine_after"] == pytest.approx(1.0, abs=1e-6) and scores["psnr_after"] == 100.0  # capped
    assert scores["cosine_before"] < 0.9 and scores["psnr_before"] < 30
    plain, _ = upload()
    exact = gradient_scores(plain, [a for a, t in zip(plain.upload, plain.trainable) if t], x, y)
    assert exact["cosine_before"] == pytest.approx(1.0, abs=1e-6) and exact["psnr_before"] == 100.0
