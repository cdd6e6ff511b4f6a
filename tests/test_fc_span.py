"""fc-span reads the images of a batch off the span of the first layer's update: exactly from a FedSGD gradient,
from a FedAvg update of reshuffled local steps through BatchNorm, and not from a DP-noised one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attackers.base import build_attack
from attackers.fc_span import SpanParams, faces_met, independent_best, input_span
from fedguard.config import ConfigError, load_config
from fedguard.data import load_dataset
from fedguard.defenses import LocalStep, build_defense
from fedguard.defenses.dp_update import UpdateDPParams
from fedguard.metrics import score_batch
from fedguard.metrics.scoring import LEAK_SSIM
from fedguard.models.mlp import MLPParams
from fedguard.observation import ModelCard, Observation
from fedguard.training import compute_gradients, get_arrays, local_sgd, loss_fn
from tests.untrained import untrained_mlp


def _model(batch_norm: bool) -> tuple[torch.nn.Module, list[np.ndarray], ModelCard]:
    _, model, arrays, card = untrained_mlp("mnist-5k", MLPParams(batch_norm=batch_norm))
    return model, arrays, card


def _digits(count: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return load_dataset("mnist-5k").test.batch(list(range(first, first + count)))


def _leaked(obs: Observation, truth: torch.Tensor, seed: int = 0) -> tuple[int, float, dict]:
    [rec] = build_attack("fc-span", SpanParams()).reconstruct_many([obs], seed)
    ssim = np.array([image["ssim"] for image in score_batch(rec.images, truth)["per_image"]])
    return int((ssim > LEAK_SSIM).sum()), float(ssim.mean()), rec.stats


def test_a_fedsgd_gradient_of_16_digits_gives_them_back() -> None:
    model, arrays, card = _model(batch_norm=False)
    x, y = _digits(16)
    grads, _ = compute_gradients(model, x, y)
    obs = card.observe(1, 0, "gradient", arrays, [g.numpy() for g in grads], 16, {"batch-size": 16})
    leaked, mean, stats = _leaked(obs, x)
    assert stats["rank"] == 16 and stats["singular_gap"] < 1e-4
    # 13 at seed 0: of the 3 others, one is not a vertex of the box in the span (it lies on an edge between
    # others), two are vertices no program reached
    assert leaked >= 13 and mean > 0.85, (leaked, mean)


def test_a_fedavg_update_of_reshuffled_steps_through_batch_norm_gives_most_of_them_back() -> None:
    """The realistic setting's client: 2 local epochs in reshuffled batches of 8 over 16 digits, lr 0.1, BatchNorm
    in training mode; the upload is the trained model."""
    model, arrays, card = _model(batch_norm=True)
    x, y = _digits(16, first=32)
    steps, _ = local_sgd(model, x, y, lr=0.1, epochs=2, batch_size=8, generator=np.random.default_rng(3))
    assert steps == 4
    declared = {"lr": 0.1, "local-epochs": 2, "batch-size": 8}
    obs = card.observe(1, 0, "weights", arrays, get_arrays(model), 16, declared)
    leaked, mean, stats = _leaked(obs, x)
    assert stats["rank"] == 16
    assert leaked >= 12 and mean > 0.8, (leaked, mean, stats["faces_met"])


def test_dp_noise_on_the_gradient_leaves_it_nothing() -> None:
    model, arrays, card = _model(batch_norm=False)
    x, y = _digits(16)
    grads, _ = compute_gradients(model, x, y)
    step = LocalStep(model, x, y, grads, loss_fn, torch.Generator().manual_seed(0), 1, 0)
    noised = build_defense("dp", UpdateDPParams(clip=1.0, noise_multiplier=0.1))(step, {})
    obs = card.observe(1, 0, "gradient", arrays, [g.numpy() for g in noised], 16, {"batch-size": 16})
    leaked, _, stats = _leaked(obs, x)
    assert stats["singular_gap"] > 0.5, "the noise fills the spectrum"
    assert leaked == 0


def test_a_repeated_digit_lowers_the_rank_and_the_others_come_back() -> None:
    model, arrays, card = _model(batch_norm=False)
    x, y = _digits(8)
    x, y = torch.cat([x, x[:1]]), torch.cat([y, y[:1]])
    grads, _ = compute_gradients(model, x, y)
    obs = card.observe(1, 0, "gradient", arrays, [g.numpy() for g in grads], 9, {"batch-size": 9})
    leaked, _, stats = _leaked(obs, x)
    assert stats["rank"] == 8 and leaked >= 7


def test_the_span_and_the_faces_it_counts() -> None:
    rng = np.random.default_rng(0)
    images = (rng.random((3, 10)) < 0.4) * rng.random((3, 10))  # pixels at 0 where they are not lit
    mixing = rng.normal(size=(5, 3))
    update = torch.from_numpy(mixing @ np.hstack([images, np.ones((3, 1))]))
    basis, singular = input_span(update, 4, 1e-9)
    assert basis.shape == (3, 11) and singular[3] < 1e-9 * singular[0]
    assert np.allclose(basis @ basis.T, np.eye(3))
    dark_in_all = (images == 0).all(0)  # every point of the span is 0 there: no face counts
    assert dark_in_all.any()
    assert faces_met(images, basis).tolist() == ((images == 0) & ~dark_in_all).sum(1).tolist()
    assert faces_met(images.mean(0, keepdims=True), basis).tolist() == [0]
    coefficients = np.vstack([images, images[:1] + 1e-7, images.mean(0, keepdims=True)]) @ basis[:, :-1].T
    # a repeat of a chosen vertex and a mixture of chosen ones are passed over
    assert independent_best(coefficients, np.array([5, 4, 3, 9, 1]), 4) == [3, 1, 2]


@pytest.mark.parametrize(
    ("field", "value"), [("tries_per_image", 0), ("pull", 0.0), ("rank_tolerance", 1.0), ("tries_per_image", 10**5)]
)
def test_bad_parameters_are_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SpanParams(**{field: value})


def test_a_model_without_a_first_linear_layer_is_refused_before_the_run() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["attack.name=fc-span", "data.name=photos", "model.name=lenet"])
    [problem] = caught.value.problems
    assert problem.startswith("attack.fc-span with model.name = 'lenet'") and "first layer is Conv2d" in problem
    load_config(None, ["attack.name=fc-span"])
