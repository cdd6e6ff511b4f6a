"""FedSGD: the server step equals centralized SGD on the union of the clients' batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedguard.data import load_dataset
from fedguard.data.federated import client_split
from fedguard.models import build_model
from fedguard.seeding import client_generators
from fedguard.training import get_arrays, loss_fn, trainable_mask
from strategies import FedSGD, SparseUploads
from strategies.fedsgd import fedsgd_step
from tests.helpers import client_fit, config, train_round


def test_one_round_equals_centralized_sgd_on_the_same_batches() -> None:
    cfg = config("train.lr=0.7")
    data = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("mlp", data.spec, cfg.model.params)
    start = get_arrays(model)

    # as the server stacks them
    strategy = SparseUploads(FedSGD(lr=cfg.train.lr, trainable=trainable_mask(model), min_train_nodes=3))
    names = list(model.state_dict())
    new, _, _ = train_round(strategy, 1, names, start, [client_fit(cfg, c, start, round_=1) for c in range(3)])

    # Centralized: the same 3 x 8 samples, one SGD step on the mean loss.
    xs, ys = [], []
    for c in range(3):
        rng, _ = client_generators(cfg.run.seed, c, 1)
        local = client_split("digits", cfg.data.source_options(), "iid", cfg.partition.options(), 4, cfg.run.seed, c)
        x, y = local.batch(rng.choice(len(local), size=8, replace=False))
        xs.append(x)
        ys.append(y)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.7)
    loss_fn(model(torch.cat(xs)), torch.cat(ys)).backward()
    optimizer.step()
    for got, want in zip(new.to_numpy_ndarrays(), get_arrays(model)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_buffers_are_averaged_and_integers_rounded() -> None:
    current = np.array([1.0, 1.0], dtype=np.float32)
    assert np.allclose(fedsgd_step(current, np.array([3.0, 2.0]), 0.5, True), [-0.5, 0.0])
    assert np.allclose(fedsgd_step(current, np.array([3.0, 2.0]), 0.5, False), [3.0, 2.0])
    counter = fedsgd_step(np.array(3, dtype=np.int64), np.array(4.5), 0.1, False)
    assert counter.dtype == np.int64 and counter == 4


def test_the_streamed_mean_equals_numpy_s_mean_bit_for_bit() -> None:
    """The server adds one upload at a time (memory flat in the clients): the same float32 sums as
    ``np.mean(np.stack(uploads), axis=0)``."""
    rng = np.random.default_rng(0)
    uploads = [rng.standard_normal((64, 33)).astype(np.float32) * 10.0 ** rng.integers(-3, 3) for _ in range(300)]
    names = ["w"]
    strategy = FedSGD(lr=0.1, trainable=[True])
    current = np.zeros((64, 33), dtype=np.float32)
    new, _, _ = train_round(strategy, 1, names, [current], [([u], 1, {"client": i}) for i, u in enumerate(uploads)])
    want = (current - 0.1 * np.mean(np.stack(uploads), axis=0)).astype(np.float32)
    assert np.array_equal(new.to_numpy_ndarrays()[0], want)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="lr must be > 0"):
        FedSGD(lr=0.0, trainable=[True])
    with pytest.raises(ValueError, match="trainable"):
        FedSGD(lr=0.1, trainable=[])


def test_failed_replies_are_left_out_and_none_means_no_update() -> None:
    strategy = FedSGD(lr=0.1, trainable=[True], min_train_nodes=2)
    assert strategy.aggregate_train(1, []) == (None, None)


def test_the_mean_is_uniform_and_in_client_order() -> None:
    strategy = FedSGD(lr=1.0, trainable=[True], min_train_nodes=3)
    uploads = [([np.array([float(c + 1)], np.float32)], 10 * (c + 1), {"client": 2 - c}) for c in range(3)]
    new, metrics, _ = train_round(strategy, 1, ["w"], [np.zeros(1, np.float32)], uploads)
    assert new.to_numpy_ndarrays()[0].tolist() == [-2.0]  # uniform, not weighted by examples (which gives -2.33)
    assert metrics["loss"] == pytest.approx(0.5)


def test_coordinate_encoded_and_dense_uploads_aggregate_alike() -> None:
    """FedSGD decodes a pruned upload as it reads it: a round mixing encoded and dense uploads equals the dense one."""
    from fedguard.wire.sparse import ENCODING_KEY, SPARSE, encode_arrays

    rng = np.random.default_rng(1)
    uploads = [
        [np.where(rng.random((8, 5)) < 0.2, rng.standard_normal((8, 5)), 0).astype(np.float32)] for _ in range(3)
    ]
    current = [np.ones((8, 5), dtype=np.float32)]
    dense, _, _ = train_round(
        FedSGD(lr=0.5, trainable=[True]), 1, ["w"], current, [(u, 1, {"client": i}) for i, u in enumerate(uploads)]
    )
    mixed = [
        (encode_arrays(u), 1, {"client": i, ENCODING_KEY: SPARSE}) if i != 1 else (u, 1, {"client": i})
        for i, u in enumerate(uploads)
    ]
    got, _, _ = train_round(FedSGD(lr=0.5, trainable=[True]), 1, ["w"], current, mixed)
    assert np.array_equal(got.to_numpy_ndarrays()[0], dense.to_numpy_ndarrays()[0])
