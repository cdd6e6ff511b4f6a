"""The defense-aware distances: zero (or least) at the true gradient for every upload the defense could have sent
from it, and what each shipped defense declares it reveals."""

from __future__ import annotations

import math

import pytest
import torch

from attackers.engine.aware import (
    LIKELIHOOD_START,
    LIKELIHOOD_WEIGHT,
    ROUNDING_MARGIN,
    aware_distance,
    aware_phases,
    band_distance,
    clipped_distance,
    levels_distance,
    orthogonal_distance,
    radius_distance,
    rounding_nll,
)
from attackers.engine.terms import cosine_distance
from fedguard.defenses import build_defense
from fedguard.defenses.censor import CensorParams
from fedguard.defenses.dgp import DGPParams
from fedguard.defenses.dp_sgd import DPSGDParams
from fedguard.defenses.dp_update import UpdateDPParams
from fedguard.defenses.pruning import PruneParams
from fedguard.defenses.quantization import QuantizeParams, level_grid
from fedguard.defenses.revealed import (
    AlteredLayer,
    ClippedNoise,
    OrthogonalPerTensor,
    QuantizedLevels,
    SentBand,
    TowardsRobustData,
    Unchanged,
    Undeclared,
    WithinRadius,
    revealed_by,
)


def gradient(seed: int = 0, jobs: int = 1) -> list[torch.Tensor]:
    """A (J, ...) gradient of three tensors with entries of varied magnitudes."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn((jobs, *shape), generator=generator) * scale
        for shape, scale in (((6, 5), 1.0), ((6,), 0.3), ((4, 6), 2.0))
    ]


def simulated(defense: str, params: object, g: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    return build_defense(defense, params).simulate(g, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("defense, params", [("prune", PruneParams(keep=0.3)), ("dgp", DGPParams(k1=0.1, k2=0.5))])
def test_the_band_distance_is_zero_at_the_true_gradient_at_any_scale_and_positive_elsewhere(defense, params) -> None:
    g = gradient()
    t = simulated(defense, params, g)
    distance = aware_distance(revealed_by(build_defense(defense, params)))
    assert float(distance(g, t)) == pytest.approx(0, abs=1e-6)
    assert float(distance([3 * x for x in g], t)) == pytest.approx(0, abs=1e-6), "the scale is the upload's"
    other = gradient(seed=5)
    assert float(distance(other, t)) > 0.1


def test_the_band_distance_counts_unsent_entries_that_the_defense_would_have_sent() -> None:
    g = gradient()
    t = simulated("prune", PruneParams(keep=0.3), g)
    moved = [x.clone() for x in g]
    unsent = t[0] == 0
    moved[0][unsent] = 10.0  # far above every sent magnitude: top-k pruning would have sent them
    assert float(cosine_distance([x * (y != 0) for x, y in zip(moved, t)], t)) == pytest.approx(0, abs=1e-6)
    assert float(band_distance(False)(moved, t)) > 1, "only the penalty on the unsent entries sees the change"
    assert float(band_distance(True)(moved, t)) == pytest.approx(0, abs=1e-6), "DGP drops the largest too"


def test_the_rounding_likelihood_is_the_frequency_with_which_stochastic_rounding_sends_each_entry_there() -> None:
    """exp(-rounding_nll(d)) against 4,000 draws of the defense on one gradient: each entry's share of draws that
    land on the level the first draw chose, within 0.03 (the binomial standard error is at most 0.008)."""
    g = gradient()
    defense = build_defense("quantize", QuantizeParams(bits=3))
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([torch.cat([x.flatten() for x in defense.simulate(g, generator)]) for _ in range(4000)])
    upload = [x.reshape(g[i].shape) for i, x in enumerate(torch.split(draws[0], [x.numel() for x in g]))]
    frequency = (draws == draws[0]).double().mean(0)
    steps = torch.cat([level_grid(x.flatten(1), 3)[2].expand(-1, x[0].numel()) for x in g], 1)[0]
    d = (torch.cat([x.flatten() for x in g]) - draws[0]).abs() / steps
    assert bool((d < 1).all()), "every entry within one level step of its upload"
    likely = d < 1 - ROUNDING_MARGIN
    assert torch.allclose(torch.exp(-rounding_nll(d[likely])).double(), frequency[likely], atol=0.03)
    distance = levels_distance(3)
    assert float(distance(g, upload)) < float(distance(gradient(seed=5), upload)), "the true gradient is likelier"
    assert float(distance(g, upload)) < float(distance([x + 0.3 for x in g], upload))


def test_the_rounding_likelihood_goes_on_as_a_line_of_the_same_slope_beyond_its_knee() -> None:
    knee = 1 - ROUNDING_MARGIN
    d = torch.tensor([knee - 1e-4, knee, knee + 1e-4, 3.0], dtype=torch.float64, requires_grad=True)
    values = rounding_nll(d)
    (slopes,) = torch.autograd.grad(values.sum(), d)
    values = values.detach()
    assert float(values[1]) == pytest.approx(-math.log(ROUNDING_MARGIN))
    assert float(slopes[0]) == pytest.approx(1 / ROUNDING_MARGIN, rel=1e-2)
    assert float(slopes[2]) == pytest.approx(1 / ROUNDING_MARGIN) and float(slopes[3]) == float(slopes[2])
    assert float(values[3]) == pytest.approx(-math.log(ROUNDING_MARGIN) + (3.0 - knee) / ROUNDING_MARGIN)


def test_the_radius_distance_accepts_exactly_the_ball_the_defense_allows() -> None:
    g = gradient(jobs=2)
    norm = torch.sqrt(sum((x.flatten(1) ** 2).sum(1) for x in g))
    direction = gradient(seed=3, jobs=2)
    dnorm = torch.sqrt(sum((x.flatten(1) ** 2).sum(1) for x in direction))
    for scale, inside in ((0.99, True), (3.0, False)):  # the bound r <= eps ||t|| / (1 - eps) admits up to 2x
        t = [
            x + scale * 0.25 * (n / dn).reshape(-1, *[1] * (x.dim() - 1)) * d
            for x, d, n, dn in zip(g, direction, [norm] * 3, [dnorm] * 3)
        ]
        value = radius_distance(0.25, relative=True)(g, t)
        assert bool((value == 0).all()) is inside, (scale, value)
    t = [x + 0.05 for x in g]
    assert float(radius_distance(1.0, relative=False)(g, t)[0]) == 0
    assert float(radius_distance(0.01, relative=False)(g, t)[0]) > 0


def test_a_refiner_upload_is_read_as_a_mixture_unless_the_attack_is_told_to_read_it_as_a_ball(tmp_path) -> None:
    from attackers.adaptive import AdaptiveInvertingGradients, AdaptiveInvertingGradientsParams
    from fedguard.defenses.refiner import Refiner, RefinerParams

    defense = Refiner(RefinerParams(epsilon=0.3), None, tmp_path)
    for reading, expected in (("mixture", TowardsRobustData(0.3, True)), ("radius", WithinRadius(0.3, True))):
        attack = AdaptiveInvertingGradients(AdaptiveInvertingGradientsParams(refiner=reading))
        attack.know_defense(defense)
        assert attack.revealed == expected
    with pytest.raises(ValueError, match="refiner 'ball': choose one of mixture, radius"):
        AdaptiveInvertingGradientsParams(refiner="ball")


def test_the_orthogonal_distance_is_zero_for_a_censor_candidate_and_two_for_the_gradient_itself() -> None:
    g = gradient(jobs=2)
    t = simulated("censor", CensorParams(), g)
    assert torch.allclose(orthogonal_distance(g, t), torch.zeros(2), atol=1e-5)
    assert torch.allclose(orthogonal_distance(g, g), torch.ones(2), atol=1e-5), "cos^2 = 1, norms equal"
    either = aware_distance(OrthogonalPerTensor(raw_fallback=True))
    assert torch.allclose(either(g, t), torch.zeros(2), atol=1e-5) and torch.allclose(
        either(g, g), torch.zeros(2), atol=1e-5
    ), "raw or orthogonal"
    assert (either(gradient(seed=9, jobs=2), t) > 0.1).all()


def test_the_clipped_distance_is_zero_at_the_clipped_update_whatever_the_true_norm() -> None:
    g = gradient()
    norm = float(torch.sqrt(sum((x**2).sum() for x in g)))
    t = [x / norm for x in g]  # clipped to 1
    assert float(clipped_distance(1.0)(g, t)) == pytest.approx(0, abs=1e-8)
    assert float(clipped_distance(1.0)([5 * x for x in g], t)) == pytest.approx(0, abs=1e-8)
    assert float(clipped_distance(1.0)([x / (2 * norm) for x in g], t)) == pytest.approx(0.25, rel=1e-4)


def test_each_shipped_defense_declares_what_its_upload_reveals() -> None:
    assert revealed_by(build_defense("none")) == Unchanged()
    assert revealed_by(build_defense("prune")) == SentBand(drops_top=False)
    assert revealed_by(build_defense("dgp")) == SentBand(drops_top=True)
    assert revealed_by(build_defense("quantize", QuantizeParams(bits=3))) == QuantizedLevels(3)
    assert revealed_by(build_defense("censor")) == OrthogonalPerTensor(raw_fallback=True)
    assert revealed_by(build_defense("censor", CensorParams(fallback="best"))) == OrthogonalPerTensor(False)
    assert revealed_by(build_defense("dp", UpdateDPParams(clip=2.0))) == ClippedNoise(2.0, 0.2)
    assert revealed_by(build_defense("dp-sgd")) == ClippedNoise(1.0, DPSGDParams().noise_multiplier, per_example=True)
    assert revealed_by(build_defense("soteria")) == AlteredLayer("")
    assert revealed_by(object()) == Undeclared(), "a plugin defense that declares nothing"


def test_refiner_declares_its_radius_towards_the_robust_data(tmp_path) -> None:
    from fedguard.defenses.refiner import Refiner, RefinerParams

    params = RefinerParams(epsilon=0.1, radius="absolute")
    assert Refiner(params, None, tmp_path).revealed() == TowardsRobustData(0.1, relative=False)
    assert Refiner(RefinerParams(), None, tmp_path).revealed() == TowardsRobustData(0.25, relative=True)


def test_the_quantization_aware_search_matches_the_cosine_and_adds_the_likelihood_late_only_when_asked() -> None:
    """By default the cosine throughout (IG's search); with the rounding likelihood: the cosine, then from
    LIKELIHOOD_START on the cosine plus the weighted likelihood."""
    assert aware_phases(QuantizedLevels(8)) == ((0.0, cosine_distance),)
    (first, cosine), (start, late) = aware_phases(QuantizedLevels(8), rounding_likelihood=True)
    assert (first, cosine, start) == (0.0, cosine_distance, LIKELIHOOD_START)
    g = gradient()
    t = simulated("quantize", QuantizeParams(bits=8), g)
    other = gradient(seed=5)
    expected = cosine_distance(other, t) + LIKELIHOOD_WEIGHT * levels_distance(8)(other, t)
    torch.testing.assert_close(late(other, t), expected)


def test_the_band_weight_scales_only_the_penalty_on_the_unsent_entries() -> None:
    g = gradient()
    t = simulated("dgp", DGPParams(k1=0.1, k2=0.5), g)
    other = [x.clone() for x in g]
    other[0][t[0] == 0] = t[0][t[0] != 0].abs().median()  # inside the band DGP sent: it would have been sent
    masked = cosine_distance([x * (y != 0) for x, y in zip(other, t)], t)
    full = band_distance(True)(other, t)
    assert float(full) > float(masked) + 1e-3, "only the penalty sees the unsent entries"
    torch.testing.assert_close(band_distance(True, 0.0)(other, t), masked)
    torch.testing.assert_close(band_distance(True, 0.1)(other, t), masked + 0.1 * (full - masked))
    torch.testing.assert_close(aware_phases(SentBand(True), 0.1)[0][1](other, t), masked + 0.1 * (full - masked))


def test_the_search_switches_to_the_likelihood_at_its_start() -> None:
    """The objective's loss function changes at LIKELIHOOD_START (and only there) for an 8-bit upload matched with
    the rounding likelihood."""
    from attackers.engine.objective import Objective
    from attackers.engine.problem import Problem
    from attackers.engine.spec import SearchSpec
    from tests.test_inverting_gradients import uploads

    observations, _, _ = uploads("quantize", QuantizeParams(bits=8))
    spec = SearchSpec(10, 1, "cpu", matching=QuantizedLevels(8), rounding_likelihood=True)
    objective = Objective(spec, Problem.of(spec, observations[:1], torch.device("cpu"), None), None, 0)
    before, after = objective.losses_at(LIKELIHOOD_START - 0.01), objective.losses_at(LIKELIHOOD_START)
    assert objective.losses_at(0.0) is before and objective.losses_at(0.99) is after and before is not after
    z = torch.rand(1, 1, 3, 32, 32)
    assert float(after(z)) > float(before(z)), "the likelihood term adds to the cosine"
