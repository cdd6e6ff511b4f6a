"""Class fishing: what the manipulation sends, that the fished batch gradient is the target example's, and
the attack's inversion of it.

Uploads are FedSGD gradients, computed as a client computes them, of small random convolutional models on
batches of natural photo tiles, on a model the server fished: the DLG LeNet (no BatchNorm) and the ConvNet
(BatchNorm on batch statistics, which couples the examples of a batch).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attackers.base import attack_traits, build_attack
from attackers.fishing import FishingAttackParams, FishingParams, as_target_examples, build_fishing, target_examples
from fedguard.data import load_dataset
from fedguard.data.registry import SourceOptions
from fedguard.metrics import cosine_similarity, score_batch
from fedguard.models import build_model
from fedguard.models.convnet import ConvNetParams
from fedguard.models.mlp import MLPParams
from fedguard.observation import ModelCard, Observation
from fedguard.training import (
    compute_gradients,
    get_arrays,
    gradient_upload,
    set_arrays,
    trainable_mask,
)

TARGET = 3  # the fished class
BATCH = [0, 40, 80, 120, 160, 200, 215, 230]  # test tiles of 16 pixels
ITERATIONS = 200  # of the regression test's search


@pytest.fixture(scope="module")
def tiles():
    return load_dataset("photos", SourceOptions(image_size=16))


def one_of_target(data, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A test batch of ``size`` tiles holding exactly one of class ``TARGET``, that one first."""
    _, labels = data.test.batch()
    first = int(torch.nonzero(labels == TARGET)[0])
    others = torch.nonzero(labels != TARGET).flatten()[:: max(1, len(labels) // size)][: size - 1]
    return data.test.batch(torch.cat([torch.tensor([first]), others]))


def fished(spec, width: int, params: FishingParams | None = None, seed: int = 0, name: str = "convnet"):
    """(model loaded with the fished arrays, its card, the arrays sent, the honest arrays); ``width``: the
    ConvNet's (the LeNet has none)."""
    torch.manual_seed(seed)
    model = build_model(name, spec, ConvNetParams(width=width) if name == "convnet" else None)
    model_params = {"width": width} if name == "convnet" else {}
    card = ModelCard(name, model_params, spec, tuple(model.state_dict()), tuple(trainable_mask(model)))
    honest = get_arrays(model)
    sent = build_fishing(params or FishingParams(target=TARGET))(honest, card, np.random.default_rng(seed))
    set_arrays(model, sent)
    return model, card, sent, honest


def upload(model, card: ModelCard, sent, x: torch.Tensor, y: torch.Tensor) -> Observation:
    """The observation of one client's FedSGD upload on the batch (x, y)."""
    arrays = gradient_upload(model, x, y)
    return card.observe(1, 0, "gradient", sent, arrays, len(y), {"batch-size": len(y)}, manipulation="fishing")


def test_only_the_last_layer_changes_values_and_the_target_row_is_kept(tiles) -> None:
    _, card, _, honest = fished(tiles.spec, width=4)
    before = [a.copy() for a in honest]
    sent = build_fishing(FishingParams(target=TARGET))(honest, card, np.random.default_rng(0))
    assert all(np.array_equal(a, b) for a, b in zip(honest, before)), "the input arrays were modified"
    assert [(a.shape, a.dtype) for a in sent] == [(a.shape, a.dtype) for a in honest]
    for key, old, new in zip(card.names, honest, sent):
        assert new is not old
        assert np.array_equal(old, new) != (key in {"fc.weight", "fc.bias"}), key
    weight, bias = sent[card.names.index("fc.weight")], sent[card.names.index("fc.bias")]
    others = np.arange(tiles.spec.num_classes) != TARGET
    assert (weight[others] == 0).all() and (bias[others] == 1000.0).all()
    assert np.array_equal(weight[TARGET], honest[card.names.index("fc.weight")][TARGET])


def test_a_random_target_is_drawn_by_the_server(tiles) -> None:
    drawn = set()
    for seed in range(20):
        _, card, sent, _ = fished(tiles.spec, width=2, params=FishingParams(), seed=seed)
        drawn.add(int(np.argmin(sent[card.names.index("fc.bias")])))
    assert len(drawn) >= 5 and drawn <= set(range(tiles.spec.num_classes))


def own_gradient_cosines(tiles, name: str) -> tuple[float, float]:
    """Cosine similarity of a batch-of-8 gradient of every layer below the last with the gradient of its one
    example of class ``TARGET`` alone: (on the fished model, on the honest one)."""
    model, card, sent, honest = fished(tiles.spec, width=8, name=name)
    x, y = one_of_target(tiles, 8)
    assert (y == TARGET).sum() == 1
    below = [i for i, n in enumerate(n for n, t in zip(card.names, card.trainable) if t) if not n.startswith("fc")]
    cosines = []
    for arrays in (sent, honest):
        set_arrays(model, arrays)
        batch, _ = compute_gradients(model, x, y)
        alone, _ = compute_gradients(model, x[:1], y[:1])
        cosines.append(cosine_similarity([batch[i] for i in below], [alone[i] for i in below]))
    print(name, "cosine with the target example's own gradient: fished, honest", cosines)
    return cosines[0], cosines[1]


def test_the_fished_batch_gradient_is_the_target_examples_own(tiles) -> None:
    fished_cosine, honest_cosine = own_gradient_cosines(tiles, "lenet")
    assert fished_cosine > 0.999 and honest_cosine < 0.9


def test_batch_norm_on_batch_statistics_mixes_the_other_examples_in(tiles) -> None:
    fished_cosine, _ = own_gradient_cosines(tiles, "convnet")
    assert fished_cosine < 0.5


def test_the_attack_counts_the_target_examples_and_reads_the_class_back(tiles) -> None:
    model, card, sent, _ = fished(tiles.spec, width=2)
    x, y = tiles.test.batch(BATCH)
    x, y = torch.cat([x, x[:2]]), torch.cat([y, torch.tensor([TARGET, TARGET])])
    fished_upload = upload(model, card, sent, x, y)
    (single, target), count = as_target_examples(fished_upload, 1), target_examples(fished_upload)
    assert target == TARGET and count == pytest.approx(int((y == TARGET).sum()), abs=1e-4)
    assert single.declared.record() == {"batch-size": 1, "labels": [TARGET]} and single.num_examples == 1


def relabelled(tiles, copies: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiles of ``BATCH`` (none of class ``TARGET``) and the first ``copies`` of them again, as ``TARGET``."""
    x, y = tiles.test.batch(BATCH)
    assert not (y == TARGET).any()
    return torch.cat([x, x[:copies]]), torch.cat([y, torch.full((copies,), TARGET)])


def test_the_sub_batch_is_the_target_examples_own_gradient_scaled_by_their_share(tiles) -> None:
    """Every array of the counted sub-batch, times ``B / n``, is the mean-loss gradient of the batch's ``n``
    tiles of the target class alone, the replaced rows of the last layer included."""
    model, card, sent, _ = fished(tiles.spec, width=0, name="lenet")
    x, y = relabelled(tiles, 3)
    mine = y == TARGET
    examples = int(mine.sum())
    sub, target = as_target_examples(upload(model, card, sent, x, y), examples)
    assert target == TARGET and sub.num_examples == examples == 3
    assert sub.declared.record() == {"batch-size": examples, "labels": [TARGET] * examples}
    alone, _ = compute_gradients(model, x[mine], y[mine])
    trained = [a for a, t in zip(sub.upload, sub.trainable) if t]
    for name, scaled, own in zip(card.names, trained, alone):
        np.testing.assert_allclose(scaled * len(y) / examples, own.numpy(), rtol=1e-4, atol=1e-7, err_msg=name)


def test_the_counted_images_fill_every_slot_in_turn(tiles) -> None:
    model, card, sent, _ = fished(tiles.spec, width=0, name="lenet")
    x, y = relabelled(tiles, 3)
    params = FishingAttackParams(iterations=2, device="cpu", compile="off", images="counted", max_images=2)
    recon = build_attack("fishing", params).reconstruct_many([upload(model, card, sent, x, y)], 0)[0]
    assert recon.stats["target_examples"] == pytest.approx(3, abs=1e-3) and recon.stats["images_inverted"] == 2
    assert recon.images.shape == x.shape and (recon.labels == TARGET).all()
    assert torch.equal(recon.images[2:], recon.images[: len(y) - 2])
    assert not torch.equal(recon.images[0], recon.images[1])


def test_an_honest_upload_is_refused(tiles) -> None:
    torch.manual_seed(0)
    model = build_model("convnet", tiles.spec, ConvNetParams(width=2))
    card = ModelCard("convnet", {"width": 2}, tiles.spec, tuple(model.state_dict()), tuple(trainable_mask(model)))
    x, y = tiles.test.batch(BATCH[:2])
    with pytest.raises(ValueError, match=r"fc\.weight the server sent has non-zero rows outside class \d"):
        target_examples(upload(model, card, get_arrays(model), x, y))


def test_fishing_recovers_the_one_target_tile(tiles) -> None:
    model, card, sent, _ = fished(tiles.spec, width=0, name="lenet")
    x, y = one_of_target(tiles, 8)
    params = FishingAttackParams(iterations=ITERATIONS, device="cpu", compile="off")
    recon = build_attack("fishing", params).reconstruct_many([upload(model, card, sent, x, y)], 0)[0]
    scores = score_batch(recon.images, x)
    best = max(image["ssim"] for image in scores["per_image"])
    print("fishing stats", recon.stats, "ssim", [round(image["ssim"], 3) for image in scores["per_image"]])
    assert recon.images.shape == x.shape and (recon.labels == TARGET).all()
    assert scores["per_image"][0]["ssim"] == best > 0.75  # 0.913 measured (16-pixel tiles, 200 iterations)


def test_counted_fishing_recovers_a_target_tile_out_of_32(tiles) -> None:
    """A batch of 32 with 3 tiles of class ``TARGET`` (first), inverted as the counted 3 examples."""
    _, labels = tiles.test.batch()
    mine = torch.nonzero(labels == TARGET).flatten()[::7][:3]
    others = torch.nonzero(labels != TARGET).flatten()
    x, y = tiles.test.batch(torch.cat([mine, others[:: len(others) // 29][:29]]))
    model, card, sent, _ = fished(tiles.spec, width=0, name="lenet")
    params = FishingAttackParams(iterations=400, device="cpu", compile="off", images="counted")
    recon = build_attack("fishing", params).reconstruct_many([upload(model, card, sent, x, y)], 0)[0]
    ssims = [image["ssim"] for image in score_batch(recon.images, x)["per_image"]]
    print("counted fishing stats", recon.stats, "target tiles' ssim", [round(v, 3) for v in ssims[:3]])
    assert recon.stats["images_inverted"] == 3 and recon.images.shape == x.shape
    assert max(ssims[:3]) == max(ssims) > 0.75  # 0.854 measured (the three: 0.854, 0.672, 0.726)


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda: FishingParams(target=-2), "target must be a class index >= 0 or -1 \\(drawn at random\\), got -2"),
        (lambda: FishingParams(shift=0.0), "shift must be finite and > 0, got 0.0"),
        (lambda: FishingAttackParams(iterations=0), "iterations must be >= 1, got 0"),
        (lambda: FishingAttackParams(images="all"), "images 'all': choose one of one, counted"),
        (lambda: FishingAttackParams(max_images=0), "max-images must be >= 1, got 0"),
    ],
)
def test_bad_parameters_name_the_value(bad, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bad()


def test_a_target_outside_the_classes_is_refused(tiles) -> None:
    with pytest.raises(ValueError, match=r"target = 10 is not a class of this model; choose 0 \.\. 9 or -1"):
        fished(tiles.spec, width=2, params=FishingParams(target=10))


def test_the_attack_declares_the_fishing_manipulation() -> None:
    traits = attack_traits("fishing")
    assert traits.manipulation == "fishing" and traits.uploads == {"gradient"} and not traits.needs


def test_a_model_that_cannot_train_on_one_example_is_refused(tiles) -> None:
    check = attack_traits("fishing").check_model
    assert check is not None
    check(build_model("convnet", tiles.spec, ConvNetParams(width=2)))  # BatchNorm2d: H * W values per channel
    with pytest.raises(ValueError, match=r"BatchNorm1d layer '\d+' cannot train on one"):
        check(build_model("mlp", tiles.spec, MLPParams(hidden=8, depth=2, batch_norm=True)))
