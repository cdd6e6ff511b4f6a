"""DP-SGD: per-sample gradients, per-sample clipping, Gaussian noise on the sum, the mean, and the accountant.

The per-sample gradients are checked against an independent loop of autograd calls, one sample at a time.
Statistical tolerances (fixed seeds, so deterministic; the tolerances say how far a correct implementation
could plausibly be off for an arbitrary seed): the MLP on 32x32x3 photos has n = 855,050 parameter entries;
the sample standard deviation of n Gaussian values has relative standard error 1 / sqrt(2 n) = 0.08 %, so
1 % is 13 errors; the sample mean has standard error sigma / sqrt(n) = 0.0011 sigma, we allow 0.01 sigma.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from flwr.app import RecordDict

from attackers.inverting_gradients import InvertingGradients, InvertingGradientsParams
from clients import DefendedClient
from fedguard.config import ConfigError, load_config
from fedguard.data import load_dataset
from fedguard.defenses import DEFENSES, build_defense
from fedguard.defenses.accountant import ORDERS, epsilon_spent, rdp
from fedguard.defenses.dp_sgd import (  # registers "dp-sgd"
    DPSGD,
    DPSGDParams,
    clip_factors,
    epsilon,
    per_sample_gradients,
    refuse_batch_norm,
)
from fedguard.metrics import psnr, ssim
from fedguard.models import build_model
from fedguard.models.mlp import MLPParams
from fedguard.observation import ModelCard
from fedguard.training import compute_gradients, get_arrays, loss_fn, parameters, trainable_mask
from tests.steps import batch_step as step_of

BATCH = list(range(0, 64, 8))  # 8 test-split tiles


@pytest.fixture(scope="module")
def photos():
    return load_dataset("photos")


def model_of(name: str, photos, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(name, photos.spec)


def loop_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Per-sample gradients by one autograd call per sample: (B, *shape) per trainable parameter."""
    rows = [torch.autograd.grad(loss_fn(model(x[i : i + 1]), y[i : i + 1]), parameters(model)) for i in range(len(y))]
    return [torch.stack(column) for column in zip(*rows)]


def sample_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.sqrt(sum(g.flatten(1).double().pow(2).sum(1) for g in grads))


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


# ----------------------------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("name", ["mlp", "lenet"])
def test_per_sample_gradients_equal_one_autograd_call_per_sample(name: str, photos) -> None:
    model = model_of(name, photos)
    x, y = photos.test.batch(BATCH)
    fast = per_sample_gradients(model, x, y, loss_fn)
    slow = loop_gradients(model, x, y)
    assert [f.shape for f in fast] == [(len(y), *p.shape) for p in parameters(model)]
    for f, s in zip(fast, slow):
        torch.testing.assert_close(f, s, rtol=1e-4, atol=1e-6)
    # their mean is the batch gradient
    for f, g in zip(fast, compute_gradients(model, x, y)[0]):
        torch.testing.assert_close(f.mean(0), g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["mlp", "lenet"])
def test_each_clipped_gradient_is_the_raw_one_times_min_1_clip_over_norm(name: str, photos) -> None:
    model = model_of(name, photos)
    x, y = photos.test.batch(BATCH)
    raw = loop_gradients(model, x, y)
    norms = sample_norms(raw)
    clip = float(norms.median())
    assert (norms > clip * 1.01).sum() >= 2 and (norms < clip).sum() >= 2, norms  # some clipped, some not
    fast = per_sample_gradients(model, x, y, loss_fn)
    clipped = [g * clip_factors(fast, clip).reshape(-1, *[1] * (g.dim() - 1)) for g in fast]
    assert (sample_norms(clipped) <= clip * (1 + 1e-6)).all()  # float32 rounding: about 6e-8 relative
    factor = torch.clamp(clip / norms, max=1.0).float()
    for c, r in zip(clipped, raw):
        torch.testing.assert_close(c, r * factor.reshape(-1, *[1] * (r.dim() - 1)), rtol=1e-4, atol=1e-6)
    # a sample below the clip is unchanged, one above ends at norm clip
    below, above = int(norms.argmin()), int(norms.argmax())
    assert float(sample_norms(clipped)[below]) == pytest.approx(float(norms[below]), rel=1e-5)
    assert float(sample_norms(clipped)[above]) == pytest.approx(clip, rel=1e-5)


def test_without_noise_the_upload_is_the_mean_of_the_clipped_per_sample_gradients(photos) -> None:
    model = model_of("mlp", photos)
    x, y = photos.test.batch(BATCH)
    raw = loop_gradients(model, x, y)
    norms = sample_norms(raw)
    clip = float(norms.median())
    factor = torch.clamp(clip / norms, max=1.0).float()
    expected = [(r * factor.reshape(-1, *[1] * (r.dim() - 1))).sum(0) / len(y) for r in raw]
    sent = build_defense("dp-sgd", DPSGDParams(clip=clip, noise_multiplier=0.0))(step_of(model, x, y), {})
    assert [s.shape for s in sent] == [e.shape for e in expected]
    for s, e in zip(sent, expected):
        torch.testing.assert_close(s, e, rtol=1e-5, atol=1e-6)
    # with a clip no sample reaches, it is the plain batch gradient
    loose = build_defense("dp-sgd", DPSGDParams(clip=10 * float(norms.max()), noise_multiplier=0.0))
    for s, g in zip(loose(step_of(model, x, y), {}), compute_gradients(model, x, y)[0]):
        torch.testing.assert_close(s, g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("clip", "multiplier", "batch"), [(0.5, 1.5, 8), (2.0, 0.3, 8), (1.0, 1.0, 2)])
def test_the_noise_has_std_multiplier_times_clip_over_the_batch_size(clip, multiplier, batch, photos) -> None:
    model = model_of("mlp", photos)
    x, y = photos.test.batch(BATCH[:batch])
    clean = flat(build_defense("dp-sgd", DPSGDParams(clip, 0.0))(step_of(model, x, y), {}))
    noisy = flat(build_defense("dp-sgd", DPSGDParams(clip, multiplier))(step_of(model, x, y, seed=7), {}))
    noise = (noisy - clean).double()
    sigma = multiplier * clip / batch
    assert noise.numel() == 855_050
    assert float(noise.std()) == pytest.approx(sigma, rel=0.01)
    assert abs(float(noise.mean())) < 0.01 * sigma
    assert float(noise.abs().mean()) == pytest.approx(math.sqrt(2 / math.pi) * sigma, rel=0.01)


def test_the_noise_is_determined_by_the_generator_seed(photos) -> None:
    model = model_of("lenet", photos)
    x, y = photos.test.batch(BATCH)
    defense = build_defense("dp-sgd", DPSGDParams(1.0, 1.0))
    first = flat(defense(step_of(model, x, y, seed=11), {}))
    again = flat(defense(step_of(model, x, y, seed=11), {}))
    other = flat(defense(step_of(model, x, y, seed=12), {}))
    assert torch.equal(first, again)
    assert not torch.allclose(first, other)


def test_the_client_model_and_gradients_are_left_unchanged(photos) -> None:
    model = model_of("lenet", photos)
    x, y = photos.test.batch(BATCH)
    step = step_of(model, x, y)
    before = [a.copy() for a in get_arrays(model)]
    grads = [g.clone() for g in step.grads]
    build_defense("dp-sgd", DPSGDParams(1.0, 1.0))(step, {})
    assert all(np.array_equal(a, b) for a, b in zip(get_arrays(model), before))
    assert all(torch.equal(g, h) for g, h in zip(step.grads, grads))
    assert model.training


# ----------------------------------------------------------------------------------------------- BatchNorm


def test_batch_norm_models_are_refused(photos) -> None:
    torch.manual_seed(0)
    model = build_model("mlp", photos.spec, MLPParams(hidden=16, batch_norm=True))
    x, y = photos.test.batch(BATCH)
    with pytest.raises(ValueError, match="per-sample gradients.*BatchNorm mixes the samples"):
        build_defense("dp-sgd")(step_of(model, x, y), {})
    with pytest.raises(ValueError, match=r"layers 0\.1"):
        refuse_batch_norm(nn.Sequential(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))))
    refuse_batch_norm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4)))  # per-sample normalisation is fine


def test_a_batch_norm_model_is_refused_when_the_run_is_configured() -> None:
    base = ["defense.name=dp-sgd", "train.protocol=fedsgd", "model.name=mlp", "data.name=digits"]
    with pytest.raises(ConfigError, match=r"defense.dp-sgd with model.name = 'mlp'.*BatchNorm mixes the samples"):
        load_config(None, [*base, "model.mlp.batch-norm=true"])
    assert load_config(None, [*base, "model.mlp.batch-norm=false"]).defense.name == "dp-sgd"
    with pytest.raises(ConfigError, match="model.name = 'resnet18'"):
        load_config(None, ["defense.name=dp-sgd", "train.protocol=fedsgd", "model.name=resnet18", "data.name=photos"])


# ----------------------------------------------------------------------------------------------- accounting


def balle_epsilon(rdp_values: np.ndarray, orders: np.ndarray, delta: float) -> float:
    """RDP -> (epsilon, delta)-DP by Balle et al. 2020, Theorem 21, minimised over the orders."""
    eps = rdp_values + np.log((orders - 1) / orders) - (np.log(delta) + np.log(orders)) / (orders - 1)
    return float(eps.min())


def sgm_rdp_integer(q: float, sigma: float, alpha: int) -> float:
    """RDP of one Sampled Gaussian Mechanism step at integer order ``alpha`` (Mironov et al. 2019), in log space."""
    terms = [
        math.log(math.comb(alpha, k)) + (alpha - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * sigma**2)
        for k in range(alpha + 1)
    ]
    top = max(terms)
    return (top + math.log(sum(math.exp(t - top) for t in terms))) / (alpha - 1)


def test_full_batch_rdp_is_the_gaussian_mechanism_closed_form() -> None:
    sigma, steps = 1.3, 40
    orders = np.array(ORDERS)
    np.testing.assert_allclose(rdp(sigma, 1.0, steps), steps * orders / (2 * sigma**2), rtol=1e-12)
    expected = balle_epsilon(steps * orders / (2 * sigma**2), orders, 1e-5)
    assert epsilon_spent(sigma, 1.0, steps, 1e-5) == pytest.approx(expected, rel=1e-12)
    # the classical conversion rdp + log(1/delta) / (alpha - 1), minimised in closed form, is looser
    classical = steps / (2 * sigma**2) + math.sqrt(2 * steps * math.log(1e5) / sigma**2)
    assert expected < classical < expected * 1.3


@pytest.mark.parametrize(("q", "sigma"), [(0.01, 1.1), (0.1, 0.8), (0.5, 2.0)])
def test_subsampled_rdp_matches_the_binomial_sum_at_integer_orders(q: float, sigma: float) -> None:
    values = rdp(sigma, q, 3)
    for alpha in (2, 3, 5, 12, 32, 63):
        assert values[ORDERS.index(float(alpha))] == pytest.approx(3 * sgm_rdp_integer(q, sigma, alpha), rel=1e-9)


def test_epsilon_matches_opacus_reference_value() -> None:
    # opacus/tests/accountants_test.py::test_rdp_accountant: sigma 1.5, q 0.04, 90 epochs, delta 1e-5
    assert epsilon_spent(1.5, 0.04, int(90 / 0.04), 1e-5) == pytest.approx(7.32911117143, rel=1e-9)


def test_epsilon_edge_cases_and_monotonicity() -> None:
    assert epsilon_spent(1.0, 0.1, 0) == 0.0
    assert epsilon_spent(0.0, 0.1, 1) == math.inf
    base = epsilon_spent(1.0, 0.1, 100)
    assert epsilon_spent(1.0, 0.1, 200) > base > epsilon_spent(1.0, 0.05, 100) > 0
    assert epsilon_spent(2.0, 0.1, 100) < base < epsilon_spent(1.0, 0.1, 100, delta=1e-8)
    for bad, match in [
        ({"sample_rate": 0.0}, "sample rate"),
        ({"steps": -1}, "steps"),
        ({"delta": 1.0}, "delta"),
        ({"noise_multiplier": -1.0}, "noise multiplier"),
    ]:
        with pytest.raises(ValueError, match=match):
            epsilon_spent(**{"noise_multiplier": 1.0, "sample_rate": 0.5, "steps": 1, **bad})


def test_steps_and_epsilon_accumulate_across_rounds_in_the_state(photos) -> None:
    model = model_of("mlp", photos)
    x, y = photos.test.batch(BATCH)
    params = DPSGDParams(clip=1.0, noise_multiplier=1.1, dataset_size=100, delta=1e-6)
    defense = build_defense("dp-sgd", params)
    state: dict[str, torch.Tensor] = {}
    assert defense.spent(state) == {"epsilon": 0.0, "delta": 1e-6, "steps": 0.0, "sample-rate": 0.0}
    defense(step_of(model, x, y, seed=1), state)
    one = defense.spent(state)
    assert one["steps"] == 1.0 and one["sample-rate"] == pytest.approx(0.08)
    assert one["epsilon"] == pytest.approx(epsilon_spent(1.1, 0.08, 1, 1e-6))
    state = {k: v.clone() for k, v in state.items()}  # as the client stores and reloads it between rounds
    defense(step_of(model, x, y, seed=2), state)
    two = defense.spent(state)
    assert two["steps"] == 2.0 and two["epsilon"] > one["epsilon"]
    assert two["epsilon"] == pytest.approx(epsilon_spent(1.1, 0.08, 2, 1e-6))
    assert epsilon(state, params, 1e-5) == pytest.approx(epsilon_spent(1.1, 0.08, 2, 1e-5))
    # a smaller batch counts as a step at the largest sampling rate seen (a valid bound for both)
    defense(step_of(model, x[:4], y[:4], seed=3), state)
    assert int(state["steps"]) == 3 and float(state["sample_rate"]) == pytest.approx(0.08)
    assert set(state) == {"steps", "sample_rate"}


def test_sampling_rate_is_the_batch_over_the_clients_data_set(photos) -> None:
    model = model_of("mlp", photos)
    x, y = photos.test.batch(BATCH)
    step = step_of(model, x, y)
    step.examples = 80
    defense, state = build_defense("dp-sgd", DPSGDParams(noise_multiplier=2.0)), {}
    defense(step, state)
    assert defense.spent(state)["sample-rate"] == pytest.approx(0.1)
    assert defense.report(state) == defense.spent(state)
    assert defense.report(state)["epsilon"] == pytest.approx(epsilon_spent(2.0, 0.1, 1))
    pinned, state = build_defense("dp-sgd", DPSGDParams(noise_multiplier=0.0, dataset_size=16)), {}
    pinned(step, state)
    assert pinned.spent(state)["sample-rate"] == 0.5 and "epsilon" not in pinned.report(state)  # no noise: no bound


def fedavg_upload(*overrides: str) -> tuple[list[np.ndarray], int, dict]:
    """The model change of fedguard's client's FedAvg upload (client 0, round 1, the MLP on digits), its number
    of examples and what it declares."""

    cfg = load_config(
        None,
        ["data.name=digits", "model.mlp.hidden=16", "partition.num-clients=4", "train.clients-per-round=4",
         "train.protocol=fedavg", "train.local-epochs=2", "train.lr=0.1", "train.batch-size=8", *overrides],
    )  # fmt: skip
    torch.manual_seed(0)
    arrays = get_arrays(build_model("mlp", load_dataset("digits").spec, cfg.model.params))
    upload, examples, declared = DefendedClient(cfg, 0, RecordDict()).fit(arrays, {"server-round": 1})
    return [np.asarray(a) - b for a, b in zip(arrays, upload)], examples, declared


def test_under_fedavg_every_local_step_follows_the_clipped_noised_gradient() -> None:
    plain, _, _ = fedavg_upload("defense.name=none")
    unclipped, _, _ = fedavg_upload(
        "defense.name=dp-sgd", "defense.dp-sgd.clip=1e6", "defense.dp-sgd.noise-multiplier=0"
    )
    for a, b in zip(unclipped, plain):  # clipping off, no noise: the per-example mean is the batch gradient
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    clipped, _, declared = fedavg_upload(
        "defense.name=dp-sgd", "defense.dp-sgd.clip=0.01", "defense.dp-sgd.noise-multiplier=0"
    )  # fmt: skip
    steps = declared["local-steps"]
    moved = float(np.sqrt(sum((c**2).sum() for c in clipped)))
    assert 0 < moved <= steps * 0.1 * 0.01 * (1 + 1e-5)  # each step moves at most lr * clip
    assert float(np.sqrt(sum((p**2).sum() for p in plain))) > 10 * moved
    _, examples, declared = fedavg_upload(
        "defense.name=dp-sgd", "defense.dp-sgd.clip=1", "defense.dp-sgd.noise-multiplier=1.1"
    )  # fmt: skip
    assert declared["defense.steps"] == declared["local-steps"] == 2 * -(-examples // 8)  # one accountant step each
    assert declared["defense.epsilon"] == pytest.approx(epsilon_spent(1.1, 8 / examples, declared["local-steps"]))


def test_dataset_size_zero_means_sampling_rate_one(photos) -> None:
    model = model_of("mlp", photos)
    x, y = photos.test.batch(BATCH)
    defense = build_defense("dp-sgd", DPSGDParams(noise_multiplier=2.0))
    state: dict[str, torch.Tensor] = {}
    defense(step_of(model, x, y), state)
    assert defense.spent(state)["sample-rate"] == 1.0
    assert defense.spent(state)["epsilon"] == pytest.approx(epsilon_spent(2.0, 1.0, 1))


# ----------------------------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    ("field", "match"),
    [
        ({"clip": 0.0}, r"clip must be finite and > 0, got 0\.0"),
        ({"clip": float("inf")}, "clip must be finite"),
        ({"clip": float("nan")}, "clip must be finite"),
        ({"noise_multiplier": -0.5}, r"noise-multiplier must be 0 \(no noise\) or in \[0.001, 1e\+06\].*got -0\.5"),
        ({"noise_multiplier": float("nan")}, r"noise-multiplier must be 0 \(no noise\) or in .*got nan"),
        (
            {"noise_multiplier": 1e-4},
            r"SGM_NOISE_RANGE: where the privacy accountant can compute epsilon\), got 0\.0001",
        ),
        ({"clip": 1e25, "noise_multiplier": 1e6}, r"clip \* noise-multiplier = 1e\+31: must be < 1e\+30"),
        ({"dataset_size": -1}, r"dataset-size must be >= 0 \(0: the client's own data set size\), got -1"),
        ({"delta": 0.0}, r"delta must be in \(0, 1\), got 0\.0"),
        ({"delta": 1.0}, r"delta must be in \(0, 1\), got 1\.0"),
    ],
)
def test_bad_parameters_are_rejected_naming_the_value(field: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DPSGDParams(**field)


def test_a_batch_larger_than_the_dataset_is_rejected(photos) -> None:
    model = model_of("mlp", photos)
    x, y = photos.test.batch(BATCH)
    with pytest.raises(
        ValueError, match=r"a batch of 8 samples exceeds the data set size 5 \(defense.dp-sgd.dataset-size\)"
    ):
        build_defense("dp-sgd", DPSGDParams(dataset_size=5))(step_of(model, x, y), {})


def test_dp_sgd_is_registered_with_its_parameters() -> None:
    assert DEFENSES.get("dp-sgd").params is DPSGDParams
    defense = build_defense("dp-sgd")
    assert isinstance(defense, DPSGD) and defense.params == DPSGDParams()
    assert not hasattr(defense, "simulate")


# ----------------------------------------------------------------------------------------------- attack


def test_dp_sgd_brings_inverting_gradients_down(photos) -> None:
    """IG on batch-1 FedSGD photo uploads through the MLP, undefended and under DP-SGD (C 1, sigma 1)."""
    images = [3, 150]
    model = model_of("mlp", photos)
    arrays = get_arrays(model)
    card = ModelCard(
        "mlp", {"hidden": 256, "depth": 2}, photos.spec, tuple(model.state_dict()), tuple(trainable_mask(model))
    )
    x, y = photos.test.batch(images)
    attack = InvertingGradients(InvertingGradientsParams(iterations=150, restarts=1, lr=0.025, tv=1e-4, device="cpu"))

    def attacked(defense: str, params) -> tuple[np.ndarray, np.ndarray]:
        protect = build_defense(defense, params)
        observations = []
        for i in range(len(images)):
            sent = protect(step_of(model, x[i : i + 1], y[i : i + 1], seed=i), {})
            observations.append(card.observe(1, i, "gradient", arrays, [g.numpy() for g in sent], 1, {"batch-size": 1}))
        recons = torch.cat([r.images for r in attack.reconstruct_many(observations, 0)])
        return psnr(recons, x).numpy(), ssim(recons, x).numpy()

    clean_psnr, clean_ssim = attacked("none", None)
    dp_psnr, dp_ssim = attacked("dp-sgd", DPSGDParams(clip=1.0, noise_multiplier=1.0))
    flat_image = x.mean((2, 3), keepdim=True).expand_as(x)
    floor_psnr = psnr(flat_image, x).numpy()
    print("IG psnr undefended", clean_psnr, "dp-sgd", dp_psnr, "floor", floor_psnr, "ssim", clean_ssim, dp_ssim)
    assert dp_psnr.mean() < clean_psnr.mean() - 8
    assert dp_ssim.mean() < clean_ssim.mean() - 0.3
    assert dp_psnr.mean() < floor_psnr.mean() + 3
