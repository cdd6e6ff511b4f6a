"""Dual Gradient Pruning: exact per-layer counts, the middle magnitude band, exact error-feedback conservation
across rounds, the label entry of a small bias, parameter validation, and the protection against IG."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attackers.inverting_gradients import InvertingGradients, InvertingGradientsParams
from fedguard.config import ConfigError, load_config
from fedguard.data import load_dataset
from fedguard.defenses import DEFENSES, LocalStep, build_defense
from fedguard.defenses.dgp import DGPParams, DualGradientPruning
from fedguard.metrics import psnr, ssim
from fedguard.models import build_model
from fedguard.training import compute_gradients, loss_fn
from tests.steps import update_only as step_of
from tests.untrained import untrained_mlp

SHAPES = [(256, 3072), (256,), (10, 256), (10,)]  # the MLP on 32x32 photos, reduced to one hidden layer


def update(seed: int) -> list[torch.Tensor]:
    """Heavy-tailed float32 entries of many magnitudes (Student t with 2 degrees of freedom), in SHAPES."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) / torch.rand(s, generator=g).add(1e-3).sqrt() * 1e-2 for s in SHAPES]


def dgp(**params) -> DualGradientPruning:
    return build_defense("dgp", DGPParams(**params))


def ranks(values: torch.Tensor) -> torch.Tensor:
    """Rank of each flat entry by |value|, 0 = largest, ties to the earlier position."""
    order = torch.sort(values.reshape(-1).abs(), descending=True, stable=True).indices
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))


# ----------------------------------------------------------------------------------------------- counts and band


@pytest.mark.parametrize(
    ("size", "rounding", "expected"),
    [
        (10, "protective", (1, 7)),  # the 10-entry bias: ceil(0.5) = 1 removed from the top, 2 sent
        (10, "floor", (0, 7)),  # floor would send its largest entry
        (2560, "protective", (128, 1920)),
        (786432, "protective", (39322, 589824)),  # ceil(39321.6)
        (1, "protective", (0, 0)),  # a single entry is sent
        (2, "protective", (1, 0)),
        (0, "protective", (0, 0)),
    ],
)
def test_per_layer_counts(size: int, rounding: str, expected: tuple[int, int]) -> None:
    assert dgp(rounding=rounding).counts(size) == expected


def test_counts_are_immune_to_float_error_in_the_fraction() -> None:
    assert 0.07 * 100 > 7 and 0.29 * 100 < 29  # the float products overshoot and undershoot
    assert dgp(k1=0.07, k2=0.29).counts(100) == (7, 29)
    assert dgp(k1=0.0, k2=0.0).counts(50) == (0, 0)
    assert dgp(k1=0.6, k2=0.39).counts(3) == (2, 0)  # capped: at least one entry is sent


def test_each_layer_sends_exactly_its_middle_band_as_copies() -> None:
    grads = update(0)
    defense = dgp()
    sent = defense(step_of(grads), {})
    assert [s.shape for s in sent] == [g.shape for g in grads] and all(s.dtype == torch.float32 for s in sent)
    for s, g in zip(sent, grads):
        top, bottom = defense.counts(g.numel())
        rank = ranks(g).reshape(g.shape)
        band = (rank >= top) & (rank < g.numel() - bottom)
        assert int((s != 0).sum()) == g.numel() - top - bottom == int(band.sum())
        assert torch.equal(s[band], g[band]), "the sent entries must be the update's own values"
        assert not s[~band].any()
        kept, removed_top, removed_bottom = g[band].abs(), g[rank < top].abs(), g[rank >= g.numel() - bottom].abs()
        assert kept.max() <= removed_top.min() and kept.min() >= removed_bottom.max()


def test_default_sends_twenty_percent_of_every_layer() -> None:
    sent = dgp()(step_of(update(1)), {})
    fractions = [float((s != 0).float().mean()) for s in sent]
    assert fractions[0] == pytest.approx(0.2, abs=1e-5) and fractions[3] == pytest.approx(0.2)


def test_ties_go_to_the_earlier_position_and_the_output_is_deterministic() -> None:
    flat = torch.ones(20)
    (sent,) = dgp(k1=0.1, k2=0.5)(step_of([flat]), {})
    assert torch.equal(sent != 0, torch.arange(20).ge(2) & torch.arange(20).lt(10))
    grads = update(2)
    assert all(torch.equal(a, b) for a, b in zip(dgp()(step_of(grads), {}), dgp()(step_of(grads), {})))


def test_the_label_entry_of_the_last_bias_is_never_sent() -> None:
    """Batch-1 bias gradient of the head is softmax - onehot(y): its largest entry is the label's."""
    data = load_dataset("photos")
    torch.manual_seed(0)
    model = build_model("mlp", data.spec)
    for index in (3, 40, 101):
        x, y = data.test.batch([index])
        grads, _ = compute_gradients(model, x, y)
        bias = grads[-1]
        assert bias.numel() == 10 and int(bias.abs().argmax()) == int(y[0]) and bias[y[0]] < 0
        protected = dgp()(step_of(grads), {})[-1]
        literal = dgp(rounding="floor")(step_of(grads), {})[-1]
        assert protected[y[0]] == 0 and int((protected != 0).sum()) == 2
        assert literal[y[0]] == bias[y[0]], "floor rounding sends the label entry"


def test_the_clients_gradients_are_not_changed() -> None:
    grads = update(3)
    originals = [g.clone() for g in grads]
    state: dict[str, torch.Tensor] = {}
    dgp()(step_of(grads), state)
    dgp()(step_of(grads), state)
    assert all(torch.equal(g, o) for g, o in zip(grads, originals))


# ----------------------------------------------------------------------------------------------- error feedback


def test_conservation_is_exact_over_two_rounds() -> None:
    defense, state = dgp(), {}
    raw1, raw2 = update(4), update(5)
    sent1 = defense(step_of(raw1, 1), state)
    assert sorted(state) == [f"dgp.residual.{i}" for i in range(len(SHAPES))]
    residual1 = [state[f"dgp.residual.{i}"].clone() for i in range(len(SHAPES))]
    for s, e, g in zip(sent1, residual1, raw1):
        assert torch.equal(s + e, g)
        assert e.dtype == torch.float32 and int((e != 0).sum()) == g.numel() - int((s != 0).sum())
    sent2 = defense(step_of(raw2, 2), state)
    for i, (s, e1, g) in enumerate(zip(sent2, residual1, raw2)):
        assert torch.equal(s + state[f"dgp.residual.{i}"], g + e1)


def test_the_second_round_prunes_the_update_plus_the_residual() -> None:
    defense, state = dgp(), {}
    raw1, raw2 = update(6), update(7)
    defense(step_of(raw1), state)
    residual1 = [state[f"dgp.residual.{i}"].clone() for i in range(len(SHAPES))]
    sent2 = defense(step_of(raw2), state)
    stateless = dgp(error_feedback=False)
    expected = stateless(step_of([g + e for g, e in zip(raw2, residual1)]), {})
    assert all(torch.equal(s, x) for s, x in zip(sent2, expected))
    fresh = stateless(step_of(raw2), {})
    assert not all(torch.equal(s, x) for s, x in zip(sent2, fresh)), "the residual had no effect"


def test_without_error_feedback_rounds_are_independent_and_state_is_untouched() -> None:
    defense = dgp(error_feedback=False)
    state = {"other": torch.ones(2)}
    raw = update(8)
    first = defense(step_of(raw, 1), state)
    again = defense(step_of(raw, 2), state)
    assert list(state) == ["other"]
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_bottom_scope_carries_only_the_bottom_entries() -> None:
    defense, state = dgp(ef_scope="bottom"), {}
    raw = update(9)
    sent = defense(step_of(raw), state)
    for i, (s, g) in enumerate(zip(sent, raw)):
        top, bottom = defense.counts(g.numel())
        rank = ranks(g).reshape(g.shape)
        residual = state[f"dgp.residual.{i}"]
        dropped = torch.where(rank < top, g, 0.0)
        assert torch.equal(residual != 0, rank >= g.numel() - bottom)
        assert torch.equal(s + residual + dropped, g)


def test_a_residual_of_another_shape_is_rejected() -> None:
    state = {"dgp.residual.0": torch.zeros(3)}
    with pytest.raises(ValueError, match="model changed"):
        dgp()(step_of([torch.ones(4)]), state)


# ----------------------------------------------------------------------------------------------- simulate


def test_simulate_is_the_first_round_defense_job_by_job_and_differentiable() -> None:
    jobs = [update(10), update(11)]
    batched = [torch.stack([job[i] for job in jobs]).requires_grad_() for i in range(len(SHAPES))]
    simulated = dgp().simulate(batched, torch.Generator())
    for j, job in enumerate(jobs):
        assert all(torch.equal(s[j], e) for s, e in zip(simulated, dgp()(step_of(job), {})))
    sum(s.sum() for s in simulated).backward()
    assert torch.equal(batched[3].grad != 0, simulated[3].detach() != 0)


# ----------------------------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"k1": -0.1}, r"k1 must be in \[0, 1\), got -0\.1"),
        ({"k2": 1.0}, r"k2 must be in \[0, 1\), got 1\.0"),
        ({"k1": float("nan")}, r"k1 must be in \[0, 1\), got nan"),
        ({"k1": 0.25, "k2": 0.75}, r"k1 \+ k2 must be < 1.*0\.25 \+ 0\.75"),
        ({"ef_scope": "top"}, r"ef-scope 'top': choose one of all, bottom"),
        ({"rounding": "ceil"}, r"rounding 'ceil': choose one of protective, floor"),
    ],
)
def test_bad_parameters_are_rejected(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DGPParams(**fields)


def test_registered_and_configurable() -> None:
    assert DEFENSES.get("dgp").params is DGPParams
    config = load_config(
        None,
        [
            "defense.name=dgp",
            "defense.dgp.k1=0.1",
            "defense.dgp.k2=0.7",
            "defense.dgp.error-feedback=false",
            "defense.dgp.ef-scope=bottom",
        ],
    )
    assert config.defense.params == DGPParams(k1=0.1, k2=0.7, error_feedback=False, ef_scope="bottom")
    with pytest.raises(ConfigError, match="k1 \\+ k2"):
        load_config(None, ["defense.name=dgp", "defense.dgp.k1=0.5", "defense.dgp.k2=0.5"])


# ----------------------------------------------------------------------------------------------- privacy


def ig_scores(defense: str) -> tuple[np.ndarray, np.ndarray]:
    """PSNR and SSIM of Inverting Gradients (150 iterations, 1 restart) on two batch-1 MLP photo uploads."""
    data, model, arrays, card = untrained_mlp("photos")
    x, y = data.test.batch([3, 40])
    protect = build_defense(defense)
    observations = []
    for i in range(2):
        grads, _ = compute_gradients(model, x[i : i + 1], y[i : i + 1])
        step = LocalStep(model, x[i : i + 1], y[i : i + 1], grads, loss_fn, torch.Generator().manual_seed(i), 1, i)
        observations.append(
            card.observe(1, i, "gradient", arrays, [g.numpy() for g in protect(step, {})], 1, {"batch-size": 1})
        )
    params = InvertingGradientsParams(iterations=150, restarts=1, lr=0.025, tv=1e-4, device="cpu")
    images = torch.cat([r.images for r in InvertingGradients(params).reconstruct_many(observations, 0)])
    return psnr(images, x).numpy(), ssim(images, x).numpy()


def test_dgp_defeats_inverting_gradients() -> None:
    clean_psnr, clean_ssim = ig_scores("none")
    dgp_psnr, dgp_ssim = ig_scores("dgp")
    print("IG undefended psnr", clean_psnr, "ssim", clean_ssim, "| DGP psnr", dgp_psnr, "ssim", dgp_ssim)
    assert clean_psnr.mean() > 30 and clean_ssim.mean() > 0.9
    assert dgp_psnr.mean() < clean_psnr.mean() - 12
    assert dgp_ssim.mean() < clean_ssim.mean() - 0.4
