"""Feature fishing across rounds: the step ``p_c = sigmoid(m (s - t))``, the difference of two uploads of one
batch as the gradient of the examples between the thresholds, the signed counts, the server's threshold
search, and the inversion of an isolated tile.

Uploads are FedSGD gradients, computed as a client computes them, of a random DLG LeNet on batches of 16-pixel
photo tiles.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from attackers.base import build_attack
from attackers.engine.search import search
from attackers.feature_fishing import (
    ISOLATED,
    FeatureFishingParams,
    ThresholdSearch,
    build_feature_fishing,
    interval_count,
    isolated,
    one_example,
    projections,
    signed_count,
)
from attackers.fishing import FishedSearchParams
from attackers.inverting_gradients import InvertingGradients, InvertingGradientsParams
from fedguard.config import load_config
from fedguard.data import load_dataset
from fedguard.data.dataset import ImageData
from fedguard.data.registry import SourceOptions
from fedguard.metrics.image import ssim
from fedguard.models import build_model, global_model
from fedguard.observation import ModelCard, Observation
from fedguard.runtime import client_app
from fedguard.runtime.client_app import make_client_app
from fedguard.runtime.server_app import run_server
from fedguard.store.folder import OBSERVATIONS_DIR, ROUNDS_FILE, VAULT_DIR
from fedguard.store.observation_files import load_observations
from fedguard.store.vault import read_truth
from fedguard.training import (
    compute_gradients,
    get_arrays,
    gradient_upload,
    set_arrays,
    trainable_mask,
)
from tests.local_grid import LocalGrid

TARGET = 3  # the row fished
BATCH = np.arange(0, 896, 28)  # 32 test tiles, of every class
LeNet = tuple[torch.nn.Module, ModelCard, list[np.ndarray]]  # model, card, honest arrays
SCALE = 1e5  # m, logits per unit of s (the projections here are a few units apart by 1e-3 at least)


@pytest.fixture(scope="module")
def tiles() -> ImageData:
    return load_dataset("photos", SourceOptions(image_size=16))


@pytest.fixture(scope="module")
def lenet(tiles: ImageData) -> LeNet:
    """(model, card, honest arrays) of a random LeNet."""
    torch.manual_seed(0)
    model = build_model("lenet", tiles.spec, None)
    card = ModelCard("lenet", {}, tiles.spec, tuple(model.state_dict()), tuple(trainable_mask(model)))
    return model, card, get_arrays(model)


def sent_at(lenet: LeNet, threshold: float, scale: float = SCALE) -> list[np.ndarray]:
    _, card, honest = lenet
    params = FeatureFishingParams(target=TARGET, threshold=threshold, scale=scale)
    return build_feature_fishing(params)(honest, card, np.random.default_rng(0))


def upload(lenet: LeNet, threshold: float, x: torch.Tensor, y: torch.Tensor, client: int = 1) -> Observation:
    """The FedSGD upload of the batch (x, y) on the LeNet fished at ``threshold``."""
    model, card, _ = lenet
    sent = sent_at(lenet, threshold)
    set_arrays(model, sent)
    arrays = gradient_upload(model, x, y)
    return card.observe(1, client, "gradient", sent, arrays, len(y), {"batch-size": len(y)}, manipulation="feature")


def batch_and_projections(tiles: ImageData, lenet: LeNet) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """(x, y, s, sorted s) of the batch, ``s`` under the honest LeNet."""
    model, _, honest = lenet
    set_arrays(model, honest)
    x, y = tiles.test.batch(BATCH)
    s = projections(model, x, TARGET).numpy()
    return x, y, s, np.sort(s)


def between(ordered: np.ndarray, i: int) -> float:
    """A threshold between the ``i``-th and ``i + 1``-th smallest projections."""
    return float(ordered[i] + ordered[i + 1]) / 2


def test_p_c_is_a_sigmoid_step_at_the_threshold(tiles: ImageData, lenet: LeNet) -> None:
    model, _, _ = lenet
    x, _, s, ordered = batch_and_projections(tiles, lenet)
    threshold = float(np.median(s))
    set_arrays(model, sent_at(lenet, threshold, scale=3.0))
    with torch.no_grad():
        p_c = torch.softmax(model(x).double(), dim=1)[:, TARGET].numpy()
    np.testing.assert_allclose(p_c, 1 / (1 + np.exp(-3.0 * (s - threshold))), rtol=1e-4)
    assert (ordered[1:] - ordered[:-1]).min() * SCALE > 10  # the steps below are sharp: p_c within 5e-5 of 0 or 1


def test_the_signed_counts_and_the_interval_counts(tiles: ImageData, lenet: LeNet) -> None:
    x, y, s, ordered = batch_and_projections(tiles, lenet)
    mine = (y == TARGET).numpy()
    assert 0 < mine.sum() < len(y)
    thresholds = [between(ordered, i) for i in (2, 9, 10, 20, 30)]
    counts = [signed_count(upload(lenet, t, x, y)) for t in thresholds]
    for t, count in zip(thresholds, counts):
        assert count == pytest.approx(((~mine) & (s > t)).sum() - (mine & (s <= t)).sum(), abs=1e-3)
    uploads = {t: upload(lenet, t, x, y) for t in thresholds[:3]}
    assert interval_count(uploads[thresholds[0]], uploads[thresholds[1]]) == pytest.approx(7, abs=1e-3)
    assert interval_count(uploads[thresholds[1]], uploads[thresholds[2]]) == pytest.approx(1, abs=1e-3)


def surrogate_gradient(lenet: LeNet, sent: list[np.ndarray], x: torch.Tensor) -> list[np.ndarray]:
    """Mean-loss gradient of ``x`` labelled ``TARGET + 1`` on ``sent`` with row ``c``'s bias raised to ``p_c = 1``."""
    model, card, _ = lenet
    surrogate = [a.copy() for a in sent]
    surrogate[card.names.index("fc.bias")][TARGET] += 1e6
    set_arrays(model, surrogate)
    grads, _ = compute_gradients(model, x, torch.full((len(x),), TARGET + 1))
    return [g.numpy() for g in grads]


def test_the_difference_of_two_uploads_is_the_gradient_of_the_examples_between(tiles: ImageData, lenet: LeNet) -> None:
    """Every array of ``upload(t1) - upload(t2)``, times ``B / n``, is the mean-loss gradient of the ``n``
    examples with ``t1 < s <= t2`` alone, each with ``dL/dz_c = +1``; the last layer's other rows are
    ``-(row c) / (K - 1)`` (a label spread over the other classes)."""
    _, card, _ = lenet
    x, y, s, ordered = batch_and_projections(tiles, lenet)
    by_projection = y[np.argsort(s)] == TARGET
    start = next(i for i in range(len(y) - 5) if 0 < by_projection[i + 1 : i + 6].sum() < 5)
    t1, t2 = between(ordered, start), between(ordered, start + 5)
    inside = torch.from_numpy((s > t1) & (s <= t2))
    assert inside.sum() == 5 and 0 < (y[inside] == TARGET).sum() < 5  # of the target class and of others
    low, high = upload(lenet, t1, x, y), upload(lenet, t2, x, y)
    own = surrogate_gradient(lenet, low.global_arrays, x[inside])
    others = np.arange(tiles.spec.num_classes) != TARGET
    for name, a, b, g in zip(card.names, low.upload, high.upload, own):
        difference = (a - b) * len(y) / 5
        if name.startswith("fc"):
            np.testing.assert_allclose(difference[TARGET], g[TARGET], rtol=1e-4, atol=1e-6, err_msg=name)
            np.testing.assert_allclose(difference[others], -np.stack([g[TARGET]] * 9) / 9, rtol=1e-4, atol=1e-6)
        else:
            np.testing.assert_allclose(difference, g, rtol=2e-4, atol=2e-4 * np.abs(g).max(), err_msg=name)


def test_the_isolated_upload_is_the_one_examples_surrogate_gradient(tiles: ImageData, lenet: LeNet) -> None:
    x, y, s, ordered = batch_and_projections(tiles, lenet)
    t1, t2 = between(ordered, 15), between(ordered, 16)
    low, high = upload(lenet, t1, x, y), upload(lenet, t2, x, y)
    difference = isolated(high, low)
    assert difference.num_examples == len(y) and difference.declared.extra[ISOLATED] == {
        "row": TARGET,
        "label": TARGET + 1,
        "rounds": [1, 1],
    }
    single = one_example(difference)
    one = int(np.flatnonzero((s > t1) & (s <= t2))[0])
    assert single.num_examples == 1 and single.declared.record() == {"batch-size": 1, "labels": [TARGET + 1]}
    model, _, _ = lenet
    set_arrays(model, single.global_arrays)  # the surrogate the search differentiates
    with torch.no_grad():
        assert (torch.softmax(model(torch.rand(64, *x.shape[1:])), dim=1)[:, TARGET] == 1).all()
    own = [g.numpy() for g in compute_gradients(model, x[one : one + 1], torch.tensor([TARGET + 1]))[0]]
    for name, a, g in zip(lenet[1].names, single.upload, own):
        np.testing.assert_allclose(a * len(y), g, rtol=2e-4, atol=2e-4 * np.abs(g).max(), err_msg=name)
    assert all(np.array_equal(a, b) for a, b in zip(single.upload, one_example(isolated(low, high)).upload))
    with pytest.raises(ValueError, match="not the difference of two feature-fishing uploads"):
        one_example(low)


def test_uploads_of_different_models_or_one_threshold_are_refused(tiles: ImageData, lenet: LeNet) -> None:
    x, y, _, _ = batch_and_projections(tiles, lenet)
    first = upload(lenet, 0.0, x, y)
    with pytest.raises(ValueError, match="same threshold"):
        isolated(first, upload(lenet, 0.0, x, y))
    with pytest.raises(ValueError, match="one client"):
        isolated(first, upload(lenet, 1.0, x, y, client=2))
    other = upload(lenet, 1.0, x, y)
    other.global_arrays[0] = other.global_arrays[0] + 1
    with pytest.raises(ValueError, match=r"differ in body\.0\.weight, not only in the threshold"):
        isolated(first, other)
    honest = upload(lenet, 0.0, x, y)
    honest.global_arrays[lenet[1].names.index("fc.weight")][:] = 1
    with pytest.raises(ValueError, match="has 10 non-zero rows, not one"):
        signed_count(honest)


def searched(public: np.ndarray, batch: np.ndarray, rounds: int) -> ThresholdSearch:
    """The search run on a batch of projections (none of class ``c``: ``N(t) = #{s > t}``)."""
    server = ThresholdSearch(public, len(batch))
    for _ in range(rounds):
        level = server.next_level()
        if level is None:
            break
        server.record(level, float((batch > server.threshold(level)).sum()))
    return server


def test_the_first_thresholds_enclose_one_batchs_share_of_the_public_mass() -> None:
    server = ThresholdSearch(np.linspace(0, 1, 1001), 32)
    first = server.next_level()
    assert first is not None
    server.record(first, 0)
    assert (first, server.next_level()) == pytest.approx((0.5 - 1 / 64, 0.5 + 1 / 64))
    assert server.threshold(0.25) == pytest.approx(0.25) and server.scale == pytest.approx(
        1e4 / math.sqrt(1 / 12), 1e-2
    )


@pytest.mark.parametrize("seed", range(20))
def test_the_search_isolates_one_example_within_16_rounds(seed: int) -> None:
    rng = np.random.default_rng(seed)
    batch = rng.normal(size=32)
    server = searched(rng.normal(size=500), batch, 16)
    found = server.found()
    assert found is not None and len(server.probes) <= 16
    low, high = (server.threshold(u) for u in found)
    assert ((batch > low) & (batch <= high)).sum() == 1


def test_an_empty_interval_widens_and_a_crowded_one_splits() -> None:
    public = np.linspace(0, 1, 101)
    empty = searched(public, np.array([0.02, 0.03, 0.97, 0.98]), 2)  # levels 0.375 and 0.625 first
    assert empty.gaps() == [(0.375, 0.625, 0)] and empty.next_level() == pytest.approx(0.875)
    empty = searched(public, np.array([0.02, 0.03, 0.97, 0.98]), 3)  # the span doubles towards more mass
    assert empty.next_level() == 0.0
    crowded = searched(public, np.array([0.45, 0.47, 0.5, 0.53, 0.55]), 2)  # levels 0.4 and 0.6
    assert crowded.gaps() == [(0.4, 0.6, 5)] and crowded.next_level() == pytest.approx(0.4 + 0.2 / 5)


def test_feature_fishing_recovers_the_isolated_tile(tiles: ImageData, lenet: LeNet) -> None:
    """Two uploads of a batch of 32 whose thresholds the search chose from the other test tiles, inverted."""
    model, _, honest = lenet
    x, y, _, _ = batch_and_projections(tiles, lenet)
    public = np.setdiff1d(np.arange(len(tiles.test)), BATCH)
    server = ThresholdSearch(projections(model, tiles.test.batch(public)[0], TARGET).numpy(), len(y))
    uploads = {}
    while (level := server.next_level()) is not None:
        uploads[level] = upload(lenet, server.threshold(level), x, y)
        server.record(level, signed_count(uploads[level]))
    found = server.found()
    assert found is not None
    spec = InvertingGradients(InvertingGradientsParams(iterations=200, device="cpu", compile="off")).spec
    recon = search(spec, [one_example(isolated(uploads[found[0]], uploads[found[1]]))], 0)[0]
    scores = ssim(recon.images.expand_as(x), x)
    set_arrays(model, honest)
    s = projections(model, x, TARGET).numpy()
    low, high = (server.threshold(u) for u in found)
    one = int(np.flatnonzero((s > low) & (s <= high))[0])
    print("rounds", len(uploads), "isolated tile", one, "ssim", round(float(scores[one]), 3))
    assert int(scores.argmax()) == one and scores[one] > 0.7


def test_the_batch_size_may_come_with_the_first_upload() -> None:
    server = ThresholdSearch(np.linspace(0, 1, 1001))
    assert server.next_level() == 0.5
    server.record(0.5, 3, batch=32)
    assert server.batch == 32 and server.next_level() == pytest.approx(0.5 + 1 / 32)
    with pytest.raises(ValueError, match="batch size is still unknown"):
        unknown = ThresholdSearch(np.linspace(0, 1, 11))
        unknown.record(0.5, 3)
        unknown.next_level()


RUN = (
    "data.name=photos",
    "data.image-size=16",
    "model.name=lenet",
    "partition.num-clients=3",
    "partition.max-per-client=32",
    "train.clients-per-round=3",
    "train.batch-size=32",
    "train.rounds=8",
    "capture.rounds=all",
    "threat.malicious=1-8:feature-fishing",
    "attack.name=none",
)


def test_a_run_isolates_one_tile_of_each_client_and_the_attack_inverts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three clients of 32 tiles under the feature-fishing server: each client's search ends within 8 rounds with an
    upload that is one of its tiles' surrogate gradient, and the attack brings that tile back."""
    monkeypatch.setattr(client_app, "in_simulation", lambda: True)  # the clients write the vault, as simulated
    cfg = load_config(None, [*RUN, f"out-dir={tmp_path / 'run'}"])
    folder = run_server(LocalGrid(make_client_app(cfg), cfg.partition.num_clients), cfg)
    fished = [o for o in load_observations(folder / OBSERVATIONS_DIR) if o.manipulation == "feature-fishing"]
    assert sorted(o.client for o in fished) == [0, 1, 2]
    rows = [json.loads(line) for line in (folder / ROUNDS_FILE).read_text().splitlines()]
    assert rows[-1]["accuracy"] != rows[0]["accuracy"], "the honest model trains once the searches are over"
    attack = build_attack("feature-fishing", FishedSearchParams(iterations=200, device="cpu", compile="off"))
    for obs, recon in zip(fished, attack.reconstruct_many(fished, 0)):
        truth = read_truth(folder / VAULT_DIR, obs.round, obs.client)
        assert truth is not None
        x, _ = truth
        single = one_example(obs)
        model = global_model(single)
        label = torch.tensor(single.declared.labels)
        matches = [
            i
            for i in range(len(x))
            if np.allclose(
                compute_gradients(model, x[i : i + 1], label)[0][0].numpy(),
                single.upload[0] * len(x),
                rtol=1e-3,
                atol=1e-3 * np.abs(single.upload[0]).max() * len(x),
            )
        ]
        assert len(matches) == 1, (obs.client, matches)
        scores = ssim(recon.images, x)
        print(
            "client",
            obs.client,
            "rounds",
            obs.declared.extra[ISOLATED]["rounds"],
            "ssim",
            round(float(scores.max()), 3),
        )
        assert recon.images.shape == x.shape and int(scores.argmax()) == matches[0] and scores.max() > 0.6
