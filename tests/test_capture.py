"""The honest-but-curious wrapper: captures exactly the targeted uploads and changes nothing else."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from flwr.serverapp.strategy import FedAvg

from fedguard.data import DataSpec
from fedguard.observation import ModelCard, Observation
from fedguard.selection import Selection
from fedguard.store.observation_files import DiskSink, load_observations, save_observation
from fedguard.wire.records import Upload
from strategies import FedSGD, HonestButCurious
from tests.helpers import ListSink, train_round

CARD = ModelCard("mlp", {"hidden": 2, "depth": 0}, DataSpec(1, 2, 2, 2), ("w", "b", "n"), (True, True, False))


NAMES = list(CARD.names)


def global_arrays(round_: int) -> list[np.ndarray]:
    return [np.full((2, 4), round_, np.float32), np.full(2, -round_, np.float32), np.array(round_, np.int64)]


def uploads(round_: int) -> list:
    rng = np.random.default_rng(round_)
    return [
        (
            [
                rng.normal(size=(2, 4)).astype(np.float32),
                rng.normal(size=2).astype(np.float32),
                np.array(round_, np.int64),
            ],
            8,
            {"client": c, "batch-size": 8, "lr": 0.1, "labels": [c, 1]},
        )
        for c in range(4)
    ]


def run_rounds(strategy, rounds: int = 3) -> list:
    aggregated = []
    for r in range(1, rounds + 1):
        arrays, _, _ = train_round(strategy, r, NAMES, global_arrays(r), uploads(r))
        aggregated.append(arrays.to_numpy_ndarrays())
    return aggregated


def fedsgd() -> FedSGD:
    return FedSGD(lr=0.1, trainable=[True, True, False], min_train_nodes=4, min_available_nodes=4)


@pytest.mark.parametrize("make_inner", [fedsgd, lambda: FedAvg(min_train_nodes=4, min_available_nodes=4)])
def test_captures_exactly_the_targets_and_keeps_aggregation(make_inner) -> None:
    sink = ListSink()
    wrapped = HonestButCurious(make_inner(), sink, CARD, "gradient", Selection.parse("1,3"), Selection.parse("0,2"))
    got = run_rounds(wrapped)
    want = run_rounds(make_inner())
    for a, b in zip(got, want):
        assert all(np.array_equal(x, y) for x, y in zip(a, b)), "the wrapper changed aggregation"
    assert [(o.round, o.client) for o in sink.items] == [(1, 0), (1, 2), (3, 0), (3, 2)]
    assert wrapped.captured == 4
    first = sink.items[0]
    assert all(np.array_equal(a, b) for a, b in zip(first.global_arrays, global_arrays(1)))
    assert all(np.array_equal(a, b) for a, b in zip(first.upload, uploads(1)[0][0]))
    assert (
        first.declared.record() == {"batch-size": 8, "lr": 0.1, "labels": [0, 1], "loss": 0.5}
        and first.num_examples == 8
    )
    assert first.kind == "gradient" and first.names == CARD.names


class LargestBatches(HonestButCurious):
    """A capture rule of one's own: only uploads declaring the largest batch of the round's clients so far."""

    def should_capture(self, server_round: int, upload: Upload) -> bool:
        return upload.declared.labels is not None and upload.declared.labels[0] >= 2


def test_the_capture_hook_chooses_what_is_captured() -> None:
    sink = ListSink()
    run_rounds(LargestBatches(fedsgd(), sink, CARD, "gradient", Selection.parse("all"), Selection.parse("all")), 2)
    assert [(o.round, o.client) for o in sink.items] == [(1, 2), (1, 3), (2, 2), (2, 3)]


def test_a_round_limit_takes_the_lowest_targeted_client_ids_whatever_the_reply_order() -> None:
    sink = ListSink()
    wrapped = HonestButCurious(fedsgd(), sink, CARD, "gradient", Selection.parse("all"), Selection.parse("1-3"), 2)
    for r in (1, 2):
        train_round(wrapped, r, NAMES, global_arrays(r), uploads(r)[::-1])
    assert [(o.round, o.client) for o in sink.items] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert wrapped.captured_in == {1: 2, 2: 2}
    with pytest.raises(ValueError, match="per_round = -1"):
        HonestButCurious(fedsgd(), sink, CARD, "gradient", Selection.parse("all"), Selection.parse("all"), -1)


def test_nothing_captured_outside_selection() -> None:
    sink = ListSink()
    run_rounds(
        HonestButCurious(
            FedAvg(min_train_nodes=4), sink, CARD, "weights", Selection.parse("none"), Selection.parse("all")
        )
    )
    assert sink.items == []


def test_rejects_unknown_upload_kind() -> None:
    with pytest.raises(ValueError, match="gradient, weights"):
        HonestButCurious(FedAvg(), ListSink(), CARD, "logits", Selection.parse("all"), Selection.parse("all"))


def observation(round_: int = 2, client: int = 5) -> Observation:
    return CARD.observe(round_, client, "gradient", global_arrays(round_), global_arrays(round_ + 1), 8, {"lr": 0.1})


def test_observation_file_round_trip(tmp_path: Path) -> None:
    obs = observation()
    path = save_observation(obs, tmp_path)
    assert path.name == "round-0002_client-0005.npz"
    [loaded] = load_observations(tmp_path)
    assert loaded.meta() == obs.meta()
    for a, b in zip(loaded.global_arrays + loaded.upload, obs.global_arrays + obs.upload):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert [p.name for p in tmp_path.iterdir()] == [path.name], "no partial file left behind"


def test_disk_sink_does_not_block_and_writes_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    real_save = save_observation

    def slow_save(obs: Observation, folder: Path) -> Path:
        gate.wait(10)
        return real_save(obs, folder)

    monkeypatch.setattr("fedguard.store.observation_files.save_observation", slow_save)
    sink = DiskSink(tmp_path)
    for client in range(3):
        sink.submit(observation(client=client))  # returns while the writer is held
    assert list(tmp_path.glob("*.npz")) == []
    gate.set()
    sink.close(timeout=10)
    assert len(load_observations(tmp_path)) == 3 and len(sink.saved) == 3


def test_observation_checks_lengths() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        CARD.observe(1, 0, "gradient", global_arrays(1)[:2], global_arrays(1), 1, {})
