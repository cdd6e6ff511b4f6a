"""The defense-aware distances: zero (or least) at the true gradient for every upload the defense could have sent
from it, and what each shipped defense declares it reveals."""

from __future__ import annotations

import pytest
import torch

from attackers.engine.aware import (
    aware_distance,
    band_distance,
    clipped_distance,
    levels_distance,
    orthogonal_distance,
    radius_distance,
)
from attackers.engine.terms import cosine_distance
from fedguard.defenses import build_defense
from fedguard.defenses.censor import CensorParams
from fedguard.defenses.dgp import DGPParams
from fedguard.defenses.dp_sgd import DPSGDParams
from fedguard.defenses.dp_update import UpdateDPParams
from fedguard.defenses.pruning import PruneParams
from fedguard.defenses.quantization import QuantizeParams
from fedguard.defenses.revealed import (
    AlteredLayer,
    ClippedNoise,
    OrthogonalPerTensor,
    QuantizedLevels,
    SentBand,
    Unchanged,
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


def test_every_entry_of_a_quantized_upload_lies_within_one_level_step_of_the_true_one() -> None:
    g = gradient(jobs=3)
    t = simulated("quantize", QuantizeParams(bits=4), g)
    exact = levels_distance(4)(g, t) - cosine_distance(g, t)
    assert torch.allclose(exact, torch.zeros(3), atol=1e-3), exact
    assert (levels_distance(4)([x + 3 for x in g], t) - cosine_distance([x + 3 for x in g], t) > 0.1).all()


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
    assert revealed_by(object()) == Unchanged(), "a plugin defense that declares nothing"


def test_refiner_declares_its_radius(tmp_path) -> None:
    from fedguard.defenses.refiner import Refiner, RefinerParams

    params = RefinerParams(epsilon=0.1, radius="absolute")
    assert Refiner(params, None, tmp_path).revealed() == WithinRadius(0.1, relative=False)
    assert Refiner(RefinerParams(), None, tmp_path).revealed() == WithinRadius(0.25, relative=True)
