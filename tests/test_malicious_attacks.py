"""Trap weights and imprint: what the malicious manipulations send, and exact recovery from real gradients.

Uploads are FedSGD gradients of the MLP on batches of natural 32x32 photo tiles, computed as a client
computes them, on a model the server manipulated.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attackers.base import build_attack
from attackers.imprint import ImprintParams, bin_edges, build_imprint
from attackers.manipulation import build_manipulation
from attackers.trap_weights import TrapWeightsParams, build_trap_weights
from fedguard.data import load_dataset
from fedguard.metrics import match, psnr
from fedguard.metrics.image import psnr_from_mse
from fedguard.metrics.matching import pairwise_mse
from fedguard.models import build_model
from fedguard.models.mlp import MLPParams
from fedguard.observation import ModelCard, Observation
from fedguard.training import (
    get_arrays,
    gradient_upload,
    set_arrays,
)
from tests.helpers import card_of

EXACT_DB = 40.0  # dB: PSNR above which an image counts as recovered exactly
IMPRINT_BATCH = [177, 16, 3, 107, 65, 57, 8, 133]  # test tiles; 3 and 8 share one of 64 brightness bins
TRAP_BATCH = [13, 52, 88, 120, 141, 160, 190, 205]


@pytest.fixture(scope="module")
def photos():
    return load_dataset("photos")


def manipulated(spec, manipulation, hidden: int, depth: int = 2, seed: int = 0):
    """(model loaded with the manipulated arrays, its card, the arrays sent)."""
    torch.manual_seed(seed)
    model = build_model("mlp", spec, MLPParams(hidden=hidden, depth=depth))
    card = card_of(model, "mlp", spec)
    sent = manipulation(get_arrays(model), card, np.random.default_rng(seed))
    set_arrays(model, sent)
    return model, card, sent


def upload(
    model, card: ModelCard, sent, x: torch.Tensor, y: torch.Tensor, name: str, declared: dict | None = None
) -> Observation:
    """The observation of one client's FedSGD upload on the batch (x, y)."""
    arrays = gradient_upload(model, x, y)
    declared = {"batch-size": len(y), **(declared or {})}
    return card.observe(1, 0, "gradient", sent, arrays, len(y), declared, manipulation=name)


def paired_psnr(images: torch.Tensor, truth: torch.Tensor) -> np.ndarray:
    """PSNR in dB of each true image against the reconstruction matched to it."""
    return psnr(images[match(images, truth, metric="psnr")], truth).numpy()


def test_trap_weights_reads_out_the_inputs_that_fire_a_unit_alone(photos) -> None:
    model, card, sent = manipulated(photos.spec, build_trap_weights(TrapWeightsParams()), hidden=1000)
    x, y = photos.test.batch(TRAP_BATCH)
    recon = build_attack("trap-weights").reconstruct_many([upload(model, card, sent, x, y, "trap-weights")], 0)[0]
    recovered = recon.stats["recovered"]
    exact = psnr_from_mse(pairwise_mse(recon.images[:recovered], x)).amax(0).numpy()  # each pure image's best match
    print("trap weights stats", recon.stats, "psnr", paired_psnr(recon.images, x))
    assert recon.images.shape == x.shape and recon.images.dtype == torch.float32
    assert recovered >= len(x) // 2, recon.stats
    assert (exact > EXACT_DB).all(), exact
    assert recon.stats["active_neurons"] >= recon.stats["candidates"] > recovered


def test_imprint_recovers_every_input_alone_in_its_bin(photos) -> None:
    params = ImprintParams(bins=64, edges="normal")
    model, card, sent = manipulated(photos.spec, build_imprint(params), hidden=256)
    x, y = photos.test.batch(IMPRINT_BATCH)
    recon = build_attack("imprint").reconstruct_many([upload(model, card, sent, x, y, "imprint")], 0)[0]
    got = paired_psnr(recon.images, x)
    bins = np.searchsorted(bin_edges(params), x.flatten(1).double().mean(1).numpy(), side="right") - 1
    alone = np.array([np.sum(bins == b) == 1 for b in bins])
    print("imprint stats", recon.stats, "psnr", got, "bins", bins)
    assert alone.sum() >= 6
    assert (got[alone] > EXACT_DB).all(), got
    assert recon.stats["non_empty"] == len(set(bins.tolist())) and recon.stats["bins"] == 64
    assert alone.sum() <= recon.stats["recovered"] <= recon.stats["non_empty"]


def test_one_shot_imprint_changes_two_units_and_returns_the_image_alone_in_its_bin(photos) -> None:
    """Two units bound the bin of 16 that holds the prior's 0.2 quantile (the fourth); every other unit stays as
    it was. Of the IMPRINT_BATCH tiles exactly one falls in that bin (checked below), and it comes back exactly."""
    params = ImprintParams(bins=16, edges="normal", layout="one-shot", target=0.2)
    torch.manual_seed(0)
    honest = get_arrays(build_model("mlp", photos.spec, MLPParams(hidden=256, depth=2)))
    model, card, sent = manipulated(photos.spec, build_imprint(params), hidden=256)
    changed = [n for n, a, b in zip(card.names, honest, sent) if not np.array_equal(a, b)]
    assert changed == ["1.weight", "1.bias", "3.weight"]
    rows = np.flatnonzero(np.any(honest[card.names.index("1.weight")] != sent[card.names.index("1.weight")], axis=1))
    columns = np.flatnonzero(np.any(honest[card.names.index("3.weight")] != sent[card.names.index("3.weight")], axis=0))
    assert rows.tolist() == [0, 1] and columns.tolist() == [1]
    lower, upper = bin_edges(params)[3:5]
    assert -sent[card.names.index("1.bias")][:2] == pytest.approx([lower, upper])
    x, y = photos.test.batch(IMPRINT_BATCH)
    means = x.flatten(1).double().mean(1).numpy()
    inside = (means >= lower) & (means < upper)
    assert inside.sum() == 1, means
    recon = build_attack("imprint").reconstruct_many([upload(model, card, sent, x, y, "imprint")], 0)[0]
    assert recon.stats["bins"] == 2 and recon.stats["recovered"] >= 1
    got = psnr_from_mse(pairwise_mse(recon.images[:1], x[inside])).item()
    assert got > EXACT_DB, got


def test_declared_labels_are_returned_as_declared(photos) -> None:
    model, card, sent = manipulated(photos.spec, build_imprint(ImprintParams(bins=8, edges="normal")), hidden=16)
    x, y = photos.test.batch([0, 1, 2])
    obs = upload(model, card, sent, x, y, "imprint", {"labels": y.tolist()})
    recon = build_attack("imprint").reconstruct_many([obs], 0)[0]
    assert recon.labels.tolist() == y.tolist() and not recon.stats["labels_inferred"]


@pytest.mark.parametrize("name", ["trap-weights", "imprint"])
def test_only_the_first_layer_and_for_imprint_the_next_one_change(photos, name: str) -> None:
    torch.manual_seed(0)
    model = build_model("mlp", photos.spec, MLPParams(hidden=32, depth=2))
    card = card_of(model, "mlp", photos.spec)
    arrays = get_arrays(model)
    before = [a.copy() for a in arrays]
    sent = build_manipulation(name, ImprintParams(bins=8, edges="normal") if name == "imprint" else None)(
        arrays, card, np.random.default_rng(0)
    )
    changed = {"trap-weights": {"1.weight", "1.bias"}, "imprint": {"1.weight", "1.bias", "3.weight"}}[name]
    assert all(np.array_equal(a, b) for a, b in zip(arrays, before)), "the input arrays were modified"
    assert [(a.shape, a.dtype) for a in sent] == [(a.shape, a.dtype) for a in arrays]
    for key, old, new in zip(card.names, arrays, sent):
        assert new is not old
        assert np.array_equal(old, new) != (key in changed), key


def test_trap_rows_have_their_positive_part_scaled(photos) -> None:
    model = build_model("mlp", photos.spec, MLPParams(hidden=64, depth=1))
    params = TrapWeightsParams(sigma=0.5, scale_factor=0.8, bias=-0.25)
    sent = build_trap_weights(params)(get_arrays(model), card_of(model, "mlp", photos.spec), np.random.default_rng(1))
    weight, bias = sent[0], sent[1]
    assert weight[weight > 0].mean() / -weight[weight < 0].mean() == pytest.approx(0.8, rel=0.01)
    assert -weight[weight < 0].mean() == pytest.approx(0.5 * np.sqrt(2 / np.pi), rel=0.01)  # E|N(0, 0.5)|
    assert (bias == -0.25).all()


def test_imprint_layout_bins_columns_and_switched_off_units(photos) -> None:
    params = ImprintParams(bins=8, edges="normal", mean=0.4, std=0.1, gain=2.0)
    model = build_model("mlp", photos.spec, MLPParams(hidden=32, depth=2))
    arrays = get_arrays(model)
    weight, bias, after, _, _head, _ = build_imprint(params)(
        arrays, card_of(model, "mlp", photos.spec), np.random.default_rng(0)
    )
    pixels = weight.shape[1]
    assert np.allclose(weight[:8], 2.0 / pixels) and (weight[8:] == 0).all() and (bias[8:] < 0).all()
    assert np.allclose(-bias[:8] / 2.0, bin_edges(params).astype(np.float32))
    assert (np.diff(bin_edges(params)) > 0).all()
    assert bin_edges(params)[4] == pytest.approx(0.4)  # the median bin edge is the prior's mean
    assert (after[:, :8] == after[:, :1]).all(), "bin columns of the next layer must be equal"
    assert np.array_equal(after[:, 8:], arrays[2][:, 8:])


def test_a_model_without_a_linear_layer_on_the_image_is_refused(photos) -> None:
    model = build_model("lenet", photos.spec)
    card = card_of(model, "lenet", photos.spec)
    for manipulation in (build_trap_weights(TrapWeightsParams()), build_imprint(ImprintParams(edges="normal"))):
        with pytest.raises(ValueError, match=r"no trainable Linear layer .*3x32x32.* body\.0\.weight \(12, 3, 5, 5\)"):
            manipulation(get_arrays(model), card, np.random.default_rng(0))


def test_imprint_needs_enough_units_and_a_next_layer(photos) -> None:
    model = build_model("mlp", photos.spec, MLPParams(hidden=256, depth=2))
    with pytest.raises(ValueError, match=r"bins = 300 exceeds the 256 units of 1\.weight; choose bins <= 256"):
        build_imprint(ImprintParams(bins=300, edges="normal"))(
            get_arrays(model), card_of(model, "mlp", photos.spec), np.random.default_rng(0)
        )
    linear = build_model("mlp", photos.spec, MLPParams(depth=0))
    with pytest.raises(ValueError, match=r"no trainable Linear layer takes the 10 units of 1\.weight"):
        build_imprint(ImprintParams(bins=4, edges="normal"))(
            get_arrays(linear), card_of(linear, "mlp", photos.spec), np.random.default_rng(0)
        )


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda: TrapWeightsParams(scale_factor=1.5), "scale_factor must be in \\(0, 1\\], got 1.5"),
        (lambda: TrapWeightsParams(sigma=0.0), "sigma must be > 0, got 0.0"),
        (lambda: ImprintParams(std=-1.0), "std must be > 0, got -1.0"),
        (lambda: ImprintParams(bins=0, edges="normal"), "bins must be >= 1, got 0"),
        (lambda: ImprintParams(edges="uniform"), "edges 'uniform': choose one of normal, public-normal, public"),
        (lambda: ImprintParams(layout="sparse"), "layout 'sparse': choose one of cumulative, one-shot"),
        (lambda: ImprintParams(layout="one-shot", bins=1), "one of bins >= 2 bins of the prior, got bins = 1"),
        (lambda: ImprintParams(target=1.0), r"target must be a quantile in \[0, 1\), got 1.0"),
    ],
)
def test_bad_parameters_name_the_value(bad, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bad()


def test_attacks_declare_the_manipulation_they_exploit() -> None:
    for name, uploads in (("trap-weights", {"gradient"}), ("imprint", {"gradient", "weights"})):
        attack = build_attack(name)
        assert attack.manipulation == name and attack.uploads == uploads and not attack.needs
