"""Soteria: the columns of one Linear layer's weight gradient with the largest |r_i| / ||d r_i / d X|| are zeroed.

The scores are recomputed here without the defense's hook or batched backward passes: the representation
from the model's own submodules, and one autograd call per (sample, feature). Inverting Gradients on
batch-1 photo uploads through the MLP (protected at its hidden -> logits layer '5') must lose the images
under plain IG and get them back when it leaves '5.weight' out of its distance (the adaptive attack).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from attackers.inverting_gradients import InvertingGradients, InvertingGradientsParams
from fedguard.data import load_dataset
from fedguard.data.spec import DataSpec
from fedguard.defenses import DEFENSES, build_defense
from fedguard.defenses.soteria import (
    Soteria,
    SoteriaParams,
    feature_scores,
    pruned_count,
    resolve_layer,
    weight_index,
)
from fedguard.metrics import psnr, ssim
from fedguard.models import build_model
from fedguard.models.convnet import ConvNetParams
from fedguard.observation import ModelCard
from fedguard.training import get_arrays, trainable_mask
from tests.steps import batch_step as step_of

SPEC = DataSpec(channels=3, height=32, width=32, num_classes=10)


@pytest.fixture(scope="module")
def photos() -> tuple[torch.Tensor, torch.Tensor]:
    return load_dataset("photos").test.batch([3, 40, 101, 150])


def model_of(name: str, params=None) -> nn.Module:
    torch.manual_seed(0)
    return build_model(name, SPEC, params)


def slow_scores(model: nn.Module, head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """sum_b |r_bi| / ||d r_bi / d x_b||, one autograd call per (sample, feature); r = head(x) on a copy."""
    head = copy.deepcopy(head)  # BatchNorm statistics of the model stay untouched
    xb = x.clone().requires_grad_(True)
    r = head(xb).flatten(1)
    scores = torch.zeros(r.shape)
    for b in range(len(x)):
        for i in range(r.shape[1]):
            (g,) = torch.autograd.grad(r[b, i], xb, retain_graph=True)
            norm = g[b].norm()
            scores[b, i] = r[b, i].detach().abs() / norm if norm > 0 else 0.0
    return scores.sum(0)


CASES = {  # model -> (the model up to the protected layer's input, that layer, batch size, percent)
    "mlp": lambda m: (m[:5], "5", 3, 25.0),
    "lenet": lambda m: (m.body, "fc", 2, 60.0),
    "convnet": lambda m: (m.features, "fc", 1, 40.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_prunes_exactly_the_top_scoring_columns(name: str, photos) -> None:
    model = model_of(name, ConvNetParams(width=4) if name == "convnet" else None)
    head, layer, batch, percent = CASES[name](model)
    x, y = photos[0][:batch], photos[1][:batch]
    step = step_of(model, x, y)
    index = weight_index(model, layer)
    features = step.grads[index].shape[1]

    sent = build_defense("soteria", SoteriaParams(percent=percent))(step, {})

    reference = slow_scores(model, head, x)
    assert torch.allclose(feature_scores(model, layer, x), reference, rtol=1e-4, atol=1e-8)
    raw, out = step.grads[index], sent[index]
    changed = (out != raw).any(0)
    zeroed = torch.zeros(features, dtype=torch.bool)
    zeroed[Soteria(SoteriaParams(percent=percent)).pruned_features(model, layer, x)] = True
    assert int(zeroed.sum()) == pruned_count(percent, features) == math.ceil(percent * features / 100)
    assert (out[:, zeroed] == 0).all() and torch.equal(out[:, ~zeroed], raw[:, ~zeroed])
    assert torch.equal(changed, zeroed & (raw != 0).any(0))
    # the pruned features are the largest scores: every pruned score >= every kept score
    assert reference[zeroed].min() >= reference[~zeroed].max() * (1 - 1e-5), "must prune the LARGEST scores"
    for j, (a, b) in enumerate(zip(step.grads, sent)):
        if j != index:
            assert torch.equal(a, b)


def test_dead_relu_features_score_zero_and_are_pruned_last(photos) -> None:
    """On the MLP at the default 60 %, every live feature is pruned before any dead one (r = 0)."""
    model = model_of("mlp")
    x = photos[0][:1]
    r = model[:5](x)[0]
    scores = feature_scores(model, "5", x)
    assert torch.equal(scores == 0, r == 0)
    pruned = Soteria(SoteriaParams()).pruned_features(model, "5", x)
    live = int((r > 0).sum())
    assert len(pruned) == 154 and live < 154
    assert set(pruned[:live].tolist()) == set(torch.nonzero(r > 0).flatten().tolist())


def test_model_state_and_mode_are_untouched_with_batchnorm(photos) -> None:
    model = model_of("convnet", ConvNetParams(width=4))
    x, y = photos[0][:2], photos[1][:2]
    step = step_of(model, x, y)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sent = build_defense("soteria", SoteriaParams())(step, {})
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and model.training
    assert all(a.shape == b.shape and a.dtype == b.dtype for a, b in zip(step.grads, sent))


def test_percent_zero_uploads_the_raw_gradient_and_chunks_do_not_matter(photos) -> None:
    model = model_of("lenet")
    x, y = photos[0][:2], photos[1][:2]
    step = step_of(model, x, y)
    sent = build_defense("soteria", SoteriaParams(percent=0))(step, {})
    assert all(torch.equal(a, b) for a, b in zip(step.grads, sent))
    one = Soteria(SoteriaParams(chunk=1))
    assert torch.allclose(feature_scores(model, "fc", x, chunk=1), feature_scores(model, "fc", x), rtol=1e-5)
    first, again = one(step, {}), Soteria(SoteriaParams(chunk=4096))(step, {})
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_layer_choice_default_explicit_and_errors(photos) -> None:
    for name, expected in [("mlp", "5"), ("lenet", "fc"), ("convnet", "fc"), ("resnet18", "fc")]:
        assert resolve_layer(model_of(name), "") == expected
    model = model_of("mlp")
    x, y = photos[0][:1], photos[1][:1]
    step = step_of(model, x, y)
    sent = build_defense("soteria", SoteriaParams(percent=10, layer="3"))(step, {})
    assert weight_index(model, "3") == 2
    assert int((sent[2] == 0).all(0).sum()) >= pruned_count(10, 256)
    assert all(torch.equal(a, b) for j, (a, b) in enumerate(zip(step.grads, sent)) if j != 2)
    for bad in ["7", "0", "5.weight"]:
        with pytest.raises(ValueError, match="its Linear layers: 1, 3, 5"):
            build_defense("soteria", SoteriaParams(layer=bad))(step, {})
    model[5].weight.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable weight"):
        weight_index(model, "5")


def test_parameter_validation_and_registration() -> None:
    assert DEFENSES.get("soteria").params is SoteriaParams
    assert isinstance(build_defense("soteria", SoteriaParams()), Soteria)
    assert SoteriaParams() == SoteriaParams(percent=60.0, layer="", chunk=256)
    for bad in [-1.0, 100.5, float("nan"), float("inf")]:
        with pytest.raises(ValueError, match=r"percent must be in \[0, 100\]"):
            SoteriaParams(percent=bad)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        SoteriaParams(chunk=0)
    assert [pruned_count(p, n) for p, n in [(50, 256), (60, 256), (10, 10), (0.1, 10), (100, 7), (0, 9)]] == [
        128,
        154,
        1,
        1,
        7,
        0,
    ]


# --- Inverting Gradients on batch-1 photo uploads through the MLP ------------------------------------------

IG = InvertingGradientsParams(iterations=200, restarts=1, lr=0.025, tv=1e-4, device="cpu")
ATTACKED = [3, 150]


@pytest.fixture(scope="module")
def attacked() -> dict:
    """IG scores of undefended uploads, of Soteria (60 %) uploads, and of the adaptive IG on the latter."""
    data = load_dataset("photos")
    model = model_of("mlp")
    arrays = get_arrays(model)
    card = ModelCard(
        "mlp", {"hidden": 256, "depth": 2}, data.spec, tuple(model.state_dict()), tuple(trainable_mask(model))
    )
    x, y = data.test.batch(ATTACKED)
    soteria = build_defense("soteria", SoteriaParams())
    clean, defended = [], []
    for i in range(len(ATTACKED)):
        step = step_of(model, x[i : i + 1], y[i : i + 1])
        for uploads, sent in [(clean, step.grads), (defended, soteria(step, {}))]:
            uploads.append(card.observe(1, i, "gradient", arrays, [g.numpy() for g in sent], 1, {"batch-size": 1}))

    def score(observations, params) -> tuple[np.ndarray, np.ndarray]:
        images = torch.cat([r.images for r in InvertingGradients(params).reconstruct_many(observations, 0)])
        return psnr(images, x).numpy(), ssim(images, x).numpy()

    result = {
        "clean": score(clean, IG),
        "soteria": score(defended, IG),
        "adaptive": score(defended, InvertingGradientsParams(**{**IG.__dict__, "skip": "5.weight"})),
    }
    print({k: (np.round(p, 2).tolist(), np.round(s, 3).tolist()) for k, (p, s) in result.items()})
    return result


def test_soteria_lowers_plain_inverting_gradients(attacked) -> None:
    (clean_psnr, clean_ssim), (psnr_, ssim_) = attacked["clean"], attacked["soteria"]
    assert clean_psnr.mean() > 40 and clean_ssim.mean() > 0.95, "the undefended attack must work"
    assert (psnr_ < clean_psnr - 10).all(), (psnr_, clean_psnr)
    assert ssim_.mean() < clean_ssim.mean() - 0.1


def test_skipping_the_protected_weight_recovers_the_images(attacked) -> None:
    """The fair test: Soteria alters only '5.weight'; IG without it still reads the images off the rest."""
    (clean_psnr, _), (plain_psnr, _), (psnr_, ssim_) = attacked["clean"], attacked["soteria"], attacked["adaptive"]
    assert psnr_.mean() > plain_psnr.mean() + 10
    assert psnr_.mean() > clean_psnr.mean() - 10 and ssim_.mean() > 0.95
