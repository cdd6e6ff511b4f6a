"""The malicious wrapper: sends manipulated models in scheduled rounds, records them, keeps the honest model."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import FedAvg

from fedguard.observation import ModelCard
from fedguard.records import array_record
from fedguard.selection import Selection
from strategies import FedSGD, HonestButCurious, Malicious
from tests.helpers import Nodes, reply
from tests.test_capture import CARD, NAMES, ListSink, global_arrays


def doubled(arrays: list[np.ndarray], card: ModelCard, rng: np.random.Generator) -> list[np.ndarray]:
    """A manipulation for the tests: doubles the first array and adds a seeded draw to the second."""
    return [arrays[0] * 2, (arrays[1] + rng.normal(size=arrays[1].shape)).astype(arrays[1].dtype), arrays[2]]


def fedsgd() -> FedSGD:
    return FedSGD(lr=0.1, trainable=[True, True, False], min_train_nodes=4, min_available_nodes=4)


def play(strategy, round_: int, uploads_from_sent: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One round of four clients, client c uploading the model it received moved by c (as weights) or that
    amount (as gradients); returns (arrays the clients received, the new global arrays)."""
    instructions = list(
        strategy.configure_train(round_, array_record(NAMES, global_arrays(round_)), ConfigRecord(), Nodes(4))
    )
    received = [m.content["arrays"].to_numpy_ndarrays() for m in instructions]
    assert all(all(np.array_equal(a, b) for a, b in zip(r, received[0])) for r in received), "clients differ"
    base = received[0] if uploads_from_sent else [np.zeros_like(a) for a in received[0]]
    replies = [
        reply(m, [base[0] - c, base[1] - c, base[2]], 8, {"client": c, "batch-size": 8, "lr": 0.1})
        for c, m in enumerate(instructions)
    ]
    aggregated, _ = strategy.aggregate_train(round_, replies)
    return received[0], aggregated.to_numpy_ndarrays()


def test_scheduled_rounds_send_the_manipulated_model_and_captures_record_it() -> None:
    sink = ListSink()
    strategy = Malicious(
        fedsgd(),
        sink,
        CARD,
        "gradient",
        Selection.parse("1,2"),
        Selection.parse("all"),
        {2: ("double", doubled)},
        seed=5,
    )
    honest_received, _ = play(strategy, 1, uploads_from_sent=False)
    sent, _ = play(strategy, 2, uploads_from_sent=False)
    assert all(np.array_equal(a, b) for a, b in zip(honest_received, global_arrays(1)))
    expected = doubled(global_arrays(2), CARD, np.random.default_rng(np.random.SeedSequence([5, 2])))
    assert all(np.array_equal(a, b) for a, b in zip(sent, expected))
    assert [(o.round, o.manipulation) for o in sink.items] == [(1, "none")] * 4 + [(2, "double")] * 4
    assert all(np.array_equal(a, b) for a, b in zip(sink.items[-1].global_arrays, expected))


def test_fedsgd_steps_from_the_honest_model_with_the_clients_gradients() -> None:
    malicious = Malicious(
        fedsgd(), ListSink(), CARD, "gradient", Selection.parse("1"), Selection.parse("all"), {1: ("double", doubled)}
    )
    honest = HonestButCurious(fedsgd(), ListSink(), CARD, "gradient", Selection.parse("1"), Selection.parse("all"))
    _, got = play(malicious, 1, uploads_from_sent=False)
    _, want = play(honest, 1, uploads_from_sent=False)
    assert all(np.allclose(a, b) for a, b in zip(got, want))


def test_fedavg_applies_the_clients_change_to_the_honest_model() -> None:
    strategy = Malicious(
        FedAvg(min_train_nodes=4),
        ListSink(),
        CARD,
        "weights",
        Selection.parse("1"),
        Selection.parse("all"),
        {1: ("double", doubled)},
    )
    _, got = play(strategy, 1, uploads_from_sent=True)
    mean_change = -np.mean(np.arange(4))  # client c uploads sent - c
    honest = global_arrays(1)
    assert np.allclose(got[0], honest[0] + mean_change) and np.allclose(got[1], honest[1] + mean_change)
    assert all(g.shape == h.shape for g, h in zip(got, honest))


def test_a_manipulation_that_changes_the_layout_is_refused() -> None:
    def reshaped(arrays, card, rng):
        return [arrays[0].reshape(-1), *arrays[1:]]

    strategy = Malicious(
        FedAvg(min_train_nodes=4),
        ListSink(),
        CARD,
        "weights",
        Selection.parse("1"),
        Selection.parse("all"),
        {1: ("reshape", reshaped)},
    )
    with pytest.raises(ValueError, match="'reshape' changed the model's layout"):
        play(strategy, 1, uploads_from_sent=True)
