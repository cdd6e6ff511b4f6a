"""The attacker who knows the defense, in the DGP and Soteria papers' diagnostic setting: one photo tile an upload
through the untrained DLG LeNet, FedSGD round 1, labels inferred. It must come close to the undefended attack on
DGP (whose round-1 upload is the exact middle band of every tensor) and never fall below IG on quantization.

Budget: 1,000 iterations, one restart, TV 0.01 for every attack, and the band penalty at 0.1 for DGP
(``attack.ig-adaptive.band``; at 1 it pulls the LeNet's search off the images: ``docs/explanation/defenses.md``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attackers.adaptive import AdaptiveInvertingGradients, AdaptiveInvertingGradientsParams
from attackers.inverting_gradients import InvertingGradients, InvertingGradientsParams
from fedguard.data import load_dataset
from fedguard.defenses import build_defense
from fedguard.defenses.dgp import DGPParams
from fedguard.defenses.quantization import QuantizeParams
from fedguard.metrics import ssim
from fedguard.models import build_model
from fedguard.observation import ModelCard, Observation
from fedguard.training import get_arrays, trainable_mask
from tests.devices import ATTACK_DEVICE
from tests.untrained import batch_one_uploads

TILES = [0, 27, 54, 81]  # test-split tiles of four photos
BUDGET = {"iterations": 1000, "restarts": 1, "tv": 0.01, "device": ATTACK_DEVICE}


def lenet_uploads(defense: str, params: object) -> tuple[list[Observation], torch.Tensor, torch.Tensor]:
    """Round-1 batch-1 uploads of ``TILES`` through the DLG LeNet (torch seed 0), defended, and the tiles."""
    data = load_dataset("photos")
    torch.manual_seed(0)
    model = build_model("lenet", data.spec)
    card = ModelCard("lenet", {}, data.spec, tuple(model.state_dict()), tuple(trainable_mask(model)))
    arrays = get_arrays(model)
    x, y = data.test.batch(TILES)
    return batch_one_uploads(model, arrays, card, x, y, defense, params), x, y


def mean_ssim(attack: InvertingGradients, observations: list[Observation], x: torch.Tensor) -> float:
    images = torch.cat([r.images for r in attack.reconstruct_many(observations, 0)])
    return float(np.mean(ssim(images, x).numpy()))


def adaptive(defense: str, params: object, band: float = 1.0) -> AdaptiveInvertingGradients:
    attack = AdaptiveInvertingGradients(AdaptiveInvertingGradientsParams(**BUDGET, band=band))
    attack.know_defense(build_defense(defense, params))
    return attack


@pytest.fixture(scope="module")
def undefended() -> float:
    observations, x, _ = lenet_uploads("none", None)
    return mean_ssim(InvertingGradients(InvertingGradientsParams(**BUDGET)), observations, x)


def test_the_attacker_who_knows_dgp_reads_its_labels_and_comes_close_to_the_undefended_attack(undefended) -> None:
    observations, x, y = lenet_uploads("dgp", DGPParams())
    attack = adaptive("dgp", DGPParams(), band=0.1)
    results = attack.reconstruct_many(observations, 0)
    assert [int(r.labels[0]) for r in results] == y.tolist(), "DGP removed each label's bias entry; the fit restores it"
    got = float(np.mean(ssim(torch.cat([r.images for r in results]), x).numpy()))
    plain = mean_ssim(InvertingGradients(InvertingGradientsParams(**BUDGET)), observations, x)
    print(f"undefended IG {undefended:.3f}, DGP: IG {plain:.3f}, adaptive {got:.3f}")
    assert undefended > 0.6, "the undefended attack must work here for the comparison to mean anything"
    assert got >= 0.8 * undefended
    assert got > plain + 0.3


@pytest.mark.parametrize("bits", [4, 8])
def test_the_attacker_who_knows_quantization_is_at_least_as_strong_as_ig(bits: int) -> None:
    observations, x, _ = lenet_uploads("quantize", QuantizeParams(bits=bits))
    plain = mean_ssim(InvertingGradients(InvertingGradientsParams(**BUDGET)), observations, x)
    got = mean_ssim(adaptive("quantize", QuantizeParams(bits=bits)), observations, x)
    print(f"{bits}-bit quantization: IG {plain:.3f}, adaptive {got:.3f}")
    assert got >= plain
