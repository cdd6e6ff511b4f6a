"""Update-level differential privacy: L2 clipping of the whole update, then Gaussian or Laplace noise.

Statistical tolerances (all samples are drawn from fixed seeds, so the tests are deterministic; the
tolerances say how far off a correct implementation could plausibly be for an arbitrary seed):

* the sample standard deviation of n i.i.d. values has relative standard error sqrt((kurtosis - 1) / (4 n)):
  for n = 200,000 that is 0.16 % for Gaussian noise (kurtosis 3) and 0.25 % for Laplace noise (kurtosis 6),
  so a 1 % tolerance is 6 and 4 standard errors;
* the sample mean has standard error sigma / sqrt(n) = 0.0022 sigma; we allow 0.01 sigma (4.5 errors);
* the sample kurtosis has standard error about sqrt(24 / n) = 0.011 for Gaussian noise and about 0.1 for
  Laplace noise (its eighth moment is large); we allow 0.1 and 0.6, while the two values differ by 3;
* the mean absolute value is b for Laplace noise and sqrt(2 / pi) sigma = 0.80 sigma for Gaussian noise,
  with relative standard errors of 0.22 % and 0.17 %; we allow 1 %.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attackers.diffusion.noise import classical_gaussian_sigma
from fedguard.config import ConfigError, load_config
from fedguard.defenses import DEFENSES, build_defense
from fedguard.defenses.dp_update import (
    MECHANISMS,
    UpdateDP,
    UpdateDPParams,
    clip_by_global_norm,
    global_norm,
    mjolnir_code_sigma,
)
from fedguard.defenses.gaussian_mechanism import epsilon_after, gaussian_sigma
from tests.steps import update_only as step_of

LARGE = 200_000  # entries of the update whose noise is measured


def dp(clip: float = 1.0, noise_multiplier: float = 0.0, mechanism: str = "gaussian"):
    """The registered 'dp' defense with these parameters."""
    return build_defense("dp", UpdateDPParams(clip, noise_multiplier, mechanism))


def update(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    """A small update of three tensors of different shapes."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(4, 5, generator=g) * scale,
        torch.randn(5, generator=g) * scale,
        torch.randn(2, 3, 3, generator=g) * scale,
    ]


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def large_update(seed: int = 1) -> list[torch.Tensor]:
    """About 200,000 entries in three tensors, of L2 norm well above 1."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(400, 250, generator=g), torch.randn(99_000, generator=g), torch.randn(1000, generator=g)]


def noise_of(defense, grads: list[torch.Tensor], seed: int, clip: float) -> torch.Tensor:
    """The noise the defense added: its output minus the clipped update, flattened."""
    out = defense(step_of([g.clone() for g in grads], seed), {})
    return flat(out) - flat(clip_by_global_norm(grads, clip))


def kurtosis(x: torch.Tensor) -> float:
    x = x.double()
    centred = x - x.mean()
    return float((centred**4).mean() / (centred**2).mean() ** 2)


# ----------------------------------------------------------------------------------------------- clipping


def test_global_norm_is_the_norm_of_all_entries_together() -> None:
    grads = update(0)
    assert math.isclose(float(global_norm(grads)), float(torch.linalg.vector_norm(flat(grads))), rel_tol=1e-6)
    assert float(global_norm([torch.tensor([3.0]), torch.tensor([[4.0]])])) == pytest.approx(5.0)


def test_an_update_above_the_clip_is_scaled_to_norm_clip_keeping_its_direction() -> None:
    grads = update(0, scale=10.0)
    norm = float(global_norm(grads))
    assert norm > 10
    originals = [g.clone() for g in grads]
    out = dp(clip=0.5)(step_of(grads), {})

    assert [o.shape for o in out] == [g.shape for g in grads]
    assert float(global_norm(out)) == pytest.approx(0.5, rel=1e-5)
    for o, g in zip(out, grads):  # every tensor by the same factor clip / norm: the direction is kept
        torch.testing.assert_close(o, g * (0.5 / norm), rtol=1e-5, atol=1e-7)
    cosine = F.cosine_similarity(flat(out), flat(grads), dim=0)
    assert float(cosine) == pytest.approx(1.0, abs=1e-6)
    assert all(torch.equal(g, o) for g, o in zip(grads, originals)), "the defense changed the client's gradients"


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_an_update_below_the_clip_is_uploaded_unchanged_without_noise(mechanism: str) -> None:
    grads = update(1, scale=0.01)
    assert float(global_norm(grads)) < 1.0
    out = dp(clip=1.0, noise_multiplier=0.0, mechanism=mechanism)(step_of(grads), {})
    assert len(out) == len(grads)
    assert all(torch.equal(o, g) for o, g in zip(out, grads))


def test_the_clip_bound_is_exact_at_the_boundary_and_for_a_zero_update() -> None:
    zeros = [torch.zeros(3), torch.zeros(2, 2)]
    assert all(torch.equal(o, z) for o, z in zip(clip_by_global_norm(zeros, 1.0), zeros))
    at_clip = [torch.tensor([0.6, 0.8])]  # norm 1 exactly
    torch.testing.assert_close(clip_by_global_norm(at_clip, 1.0)[0], at_clip[0])


@settings(max_examples=200, deadline=None)
@given(
    arrays=st.lists(
        st.lists(st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False, width=32), min_size=1, max_size=20),
        min_size=1,
        max_size=4,
    ),
    clip=st.floats(1e-3, 1e3, allow_nan=False),
)
def test_clipping_bounds_the_norm_by_the_clip(arrays: list[list[float]], clip: float) -> None:
    tensors = [torch.tensor(a, dtype=torch.float32) for a in arrays]
    norm = float(torch.linalg.vector_norm(torch.tensor([x for a in arrays for x in a], dtype=torch.float64)))
    clipped = clip_by_global_norm(tensors, clip)
    assert [c.shape for c in clipped] == [t.shape for t in tensors]
    assert float(global_norm(clipped)) == pytest.approx(min(norm, clip), rel=1e-5, abs=1e-30)


# ----------------------------------------------------------------------------------------------- noise


@pytest.mark.parametrize(("clip", "multiplier"), [(0.5, 1.5), (2.0, 0.3)])
def test_gaussian_noise_has_standard_deviation_multiplier_times_clip(clip: float, multiplier: float) -> None:
    grads = large_update()
    assert sum(g.numel() for g in grads) == LARGE
    defense = dp(clip, multiplier, "gaussian")
    assert defense.noise_scale == pytest.approx(multiplier * clip)
    noise = noise_of(defense, grads, seed=7, clip=clip)
    sigma = multiplier * clip
    assert float(noise.std()) == pytest.approx(sigma, rel=0.01)
    assert abs(float(noise.mean())) < 0.01 * sigma
    assert kurtosis(noise) == pytest.approx(3.0, abs=0.1)
    assert float(noise.abs().mean()) == pytest.approx(math.sqrt(2 / math.pi) * sigma, rel=0.01)


@pytest.mark.parametrize(("clip", "multiplier"), [(0.5, 1.5), (2.0, 0.3)])
def test_laplace_noise_has_scale_multiplier_times_clip(clip: float, multiplier: float) -> None:
    grads = large_update()
    noise = noise_of(dp(clip, multiplier, "laplace"), grads, seed=7, clip=clip)
    b = multiplier * clip
    assert float(noise.std()) == pytest.approx(math.sqrt(2) * b, rel=0.01)
    assert abs(float(noise.mean())) < 0.01 * math.sqrt(2) * b
    assert kurtosis(noise) == pytest.approx(6.0, abs=0.6)  # Gaussian: 3
    assert float(noise.abs().mean()) == pytest.approx(b, rel=0.01)  # E|X| = b for Laplace(0, b)


@pytest.mark.parametrize(("clip", "epsilon"), [(0.5, 1.0), (3.0, 50.0)])
def test_epsilon_calibrates_the_gaussian_noise_for_sensitivity_two_clips(clip: float, epsilon: float) -> None:
    defense = build_defense("dp", UpdateDPParams(clip=clip, epsilon=epsilon, delta=1e-5))
    sigma = gaussian_sigma(epsilon, 1e-5, 2.0) * clip
    assert defense.noise_scale == pytest.approx(sigma, rel=1e-12)
    noise = noise_of(defense, large_update(), seed=7, clip=clip)
    assert float(noise.std()) == pytest.approx(sigma, rel=0.01)


def test_the_report_is_the_epsilon_spent_over_the_clients_uploads() -> None:
    defense = build_defense("dp", UpdateDPParams(clip=1.0, epsilon=2.0, delta=1e-5))
    state: dict[str, torch.Tensor] = {}
    assert defense.report(state) == {"epsilon": 0.0, "delta": 1e-5}
    defense(step_of(update(0)), state)
    assert defense.report(state)["epsilon"] == pytest.approx(2.0, rel=1e-6)
    for seed in range(3):
        defense(step_of(update(seed)), state)
    assert defense.report(state)["epsilon"] == pytest.approx(epsilon_after(4, defense.noise_multiplier, 2.0, 1e-5))
    assert 2.0 < defense.report(state)["epsilon"] < 8.0  # exact composition beats the sum of four epsilons


def test_a_noise_multiplier_reports_its_epsilon_and_laplace_noise_reports_none() -> None:
    state: dict[str, torch.Tensor] = {}
    gaussian = dp(1.0, 2.0, "gaussian")
    gaussian(step_of(update(0)), state)
    assert gaussian.report(state)["epsilon"] == pytest.approx(epsilon_after(1, 2.0, 2.0, 1e-5))
    laplace, laplace_state = dp(1.0, 2.0, "laplace"), {}
    laplace(step_of(update(0)), laplace_state)
    assert laplace.report(laplace_state) == {}
    silent, silent_state = dp(1.0, 0.0, "gaussian"), {}
    silent(step_of(update(0)), silent_state)
    assert silent.report(silent_state) == {}


def test_epsilon_with_laplace_noise_or_with_a_noise_multiplier_is_rejected() -> None:
    with pytest.raises(ValueError, match="gaussian mechanism only, not 'laplace'"):
        UpdateDPParams(epsilon=1.0, mechanism="laplace")
    with pytest.raises(ValueError, match=r"noise-multiplier \(0.5\) or epsilon \(1.0\), not both"):
        UpdateDPParams(noise_multiplier=0.5, epsilon=1.0)
    with pytest.raises(ValueError, match="epsilon must be finite and >= 0"):
        UpdateDPParams(epsilon=-1.0)
    with pytest.raises(ValueError, match="delta must be in"):
        UpdateDPParams(delta=0.0)


# Mjölnir's published code: M = 2 * lr * C / m * sqrt(2 ln(1.25 / delta)) / epsilon, lr 1e-3, C 10, m 1.
@pytest.mark.parametrize(
    ("epsilon", "delta", "std"),
    [(1.0, 1e-4, 0.08687), (1.0, 1e-5, 0.09690), (5.0, 1e-4, 0.017374), (10.0, 1e-5, 0.009690)],
)
def test_the_mjolnir_code_calibration_sets_the_published_codes_std_whatever_the_clip(
    epsilon: float, delta: float, std: float
) -> None:
    expected = 0.02 * math.sqrt(2 * math.log(1.25 / delta)) / epsilon
    assert mjolnir_code_sigma(epsilon, delta) == expected == pytest.approx(std, rel=1e-4)
    assert expected == pytest.approx(classical_gaussian_sigma(epsilon, delta, 0.02), rel=1e-15)
    for clip in (0.01, 1.0, 40.0):
        defense = build_defense(
            "dp", UpdateDPParams(clip=clip, epsilon=epsilon, delta=delta, calibration="mjolnir-code")
        )
        assert defense.noise_scale == expected
        assert defense.noise_multiplier == expected / clip


def test_the_mjolnir_code_noise_has_that_std_on_every_entry() -> None:
    defense = build_defense("dp", UpdateDPParams(clip=1.0, epsilon=1.0, delta=1e-4, calibration="mjolnir-code"))
    noise = noise_of(defense, large_update(), seed=7, clip=1.0)
    assert float(noise.std()) == pytest.approx(mjolnir_code_sigma(1.0, 1e-4), rel=0.01)
    assert kurtosis(noise) == pytest.approx(3.0, abs=0.1)


def test_the_mjolnir_code_report_is_the_epsilon_its_std_spends_for_the_clip() -> None:
    sigma = mjolnir_code_sigma(1.0, 1e-4)
    spent = {}
    for clip in (10.0, 0.01):
        defense, state = (
            build_defense("dp", UpdateDPParams(clip=clip, epsilon=1.0, delta=1e-4, calibration="mjolnir-code")),
            {},
        )
        defense(step_of(update(0)), state)
        spent[clip] = defense.report(state)["epsilon"]
        assert defense.report(state) == {"epsilon": epsilon_after(1, sigma / clip, 2.0, 1e-4), "delta": 1e-4}
    assert spent[10.0] > 1000  # clip 10: "epsilon 1" in the paper's units spends far more
    assert spent[0.01] < 1  # a clip far below the std: less


def test_the_calibration_is_checked() -> None:
    assert UpdateDPParams().calibration == "analytic"
    with pytest.raises(ValueError, match="calibration 'paper': choose one of analytic, mjolnir-code"):
        UpdateDPParams(epsilon=1.0, calibration="paper")
    with pytest.raises(ValueError, match="calibration 'mjolnir-code' maps epsilon to a noise std: set epsilon > 0"):
        UpdateDPParams(calibration="mjolnir-code")
    with pytest.raises(ValueError, match="gaussian mechanism only, not 'laplace'"):
        UpdateDPParams(epsilon=1.0, calibration="mjolnir-code", mechanism="laplace")
    with pytest.raises(ValueError, match=r"noise-multiplier \(0.5\) or epsilon \(1.0\), not both"):
        UpdateDPParams(noise_multiplier=0.5, epsilon=1.0, calibration="mjolnir-code")
    config = load_config(
        None,
        ["defense.name=dp", "defense.dp.epsilon=5", "defense.dp.delta=1e-4", "defense.dp.calibration=mjolnir-code"],
    )
    assert build_defense(config.defense.name, config.defense.params).noise_scale == mjolnir_code_sigma(5.0, 1e-4)


def test_the_noise_of_each_tensor_is_independent() -> None:
    grads = [torch.zeros(50_000), torch.zeros(50_000)]  # zero update: the output is the noise
    out = dp(1.0, 1.0, "gaussian")(step_of(grads, seed=3), {})
    assert not torch.equal(out[0], out[1])
    correlation = torch.corrcoef(torch.stack(out))[0, 1]
    assert abs(float(correlation)) < 0.02  # standard error 1 / sqrt(50,000) = 0.0045
    for tensor in out:
        assert float(tensor.std()) == pytest.approx(1.0, rel=0.02)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_the_noise_is_determined_by_the_generator_seed(mechanism: str) -> None:
    grads = update(2)
    defense = dp(1.0, 0.5, mechanism)
    first = flat(defense(step_of(grads, seed=11), {}))
    again = flat(defense(step_of(grads, seed=11), {}))
    other = flat(defense(step_of(grads, seed=12), {}))
    assert torch.equal(first, again)
    clipped = flat(clip_by_global_norm(grads, 1.0))
    assert not torch.allclose(first, clipped), "no noise was added"
    assert not torch.allclose(first, other)
    # different seeds give unrelated noise, not a shifted or scaled copy
    assert abs(float(torch.corrcoef(torch.stack([first - clipped, other - clipped]))[0, 1])) < 0.5


def test_the_mechanisms_differ() -> None:
    grads = large_update()
    gaussian = noise_of(dp(1.0, 1.0, "gaussian"), grads, seed=5, clip=1.0)
    laplace = noise_of(dp(1.0, 1.0, "laplace"), grads, seed=5, clip=1.0)
    assert kurtosis(laplace) - kurtosis(gaussian) > 2.0


# ----------------------------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("clip", [0.0, -1.0, float("nan")])
def test_a_clip_that_is_not_positive_is_rejected(clip: float) -> None:
    with pytest.raises(ValueError, match=rf"clip must be > 0, got {clip}"):
        UpdateDPParams(clip=clip)


def test_a_negative_noise_multiplier_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"noise-multiplier must be >= 0, got -0\.25"):
        UpdateDPParams(noise_multiplier=-0.25)
    assert UpdateDPParams(noise_multiplier=0.0).noise_multiplier == 0.0


@pytest.mark.parametrize("field", [{"noise_multiplier": float("nan")}, {"clip": float("inf")}], ids=["nan", "inf"])
def test_non_finite_parameters_are_rejected(field: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="finite"):
        UpdateDPParams(**field)


def test_an_unknown_mechanism_is_rejected_naming_it_and_the_choices() -> None:
    with pytest.raises(ValueError) as error:
        UpdateDPParams(mechanism="uniform")
    assert "'uniform'" in str(error.value)
    assert "gaussian" in str(error.value) and "laplace" in str(error.value)


def test_dp_is_registered_with_its_parameters() -> None:
    entry = DEFENSES.get("dp")
    assert entry.params is UpdateDPParams
    defense = build_defense("dp")
    assert isinstance(defense, UpdateDP) and defense.params == UpdateDPParams()


def test_the_config_accepts_dp_and_its_parameters() -> None:
    config = load_config(None, ["defense.name=dp", "defense.dp.clip=0.5"])
    assert config.defense.name == "dp"
    assert config.defense.params == UpdateDPParams(clip=0.5)
    config = load_config(None, ["defense.name=dp", "defense.dp.noise-multiplier=2", "defense.dp.mechanism=laplace"])
    assert config.defense.params == UpdateDPParams(noise_multiplier=2.0, mechanism="laplace")
    defense = build_defense(config.defense.name, config.defense.params)
    assert defense.noise_scale == pytest.approx(2.0)


def test_the_config_rejects_an_unknown_mechanism_naming_it() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, ["defense.name=dp", "defense.dp.mechanism=uniform"])
    (problem,) = error.value.problems
    assert problem.startswith("defense.dp:") and "'uniform'" in problem and "gaussian, laplace" in problem


def test_the_config_rejects_a_clip_of_zero() -> None:
    with pytest.raises(ConfigError, match=r"defense\.dp: clip must be > 0, got 0\.0"):
        load_config(None, ["defense.name=dp", "defense.dp.clip=0"])
