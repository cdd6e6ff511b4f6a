"""The malicious wrapper: sends manipulated models in scheduled rounds, records them, keeps the honest model."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord
from flwr.serverapp.strategy import FedAvg

from attackers.manipulation import ClientManipulation
from fedguard.observation import ModelCard, Observation
from fedguard.selection import Selection
from fedguard.wire.records import array_record
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


class Offsets:
    """A ``ClientManipulation`` for the tests: node ``n`` is sent the honest arrays plus ``n`` in its first two
    rounds, then the honest ones; after its second upload it hands over an observation of that upload with the
    first one's upload subtracted."""

    def __init__(self) -> None:
        self.seen: dict[int, list[Observation]] = {}

    def check(self, arrays: list[np.ndarray], card: ModelCard) -> None:
        pass

    def send(
        self, node: int, arrays: list[np.ndarray], card: ModelCard, rng: np.random.Generator
    ) -> list[np.ndarray] | None:
        if len(self.seen.get(node, [])) >= 2:
            return None
        return [arrays[0] + node, arrays[1] + node, arrays[2]]

    def learn(self, node: int, obs: Observation) -> Observation | None:
        seen = self.seen.setdefault(node, [])
        seen.append(obs)
        if len(seen) != 2:
            return None
        return dataclasses.replace(obs, upload=[a - b for a, b in zip(obs.upload, seen[0].upload)])


def test_a_search_sends_each_node_its_own_model_and_hands_over_what_it_derives() -> None:
    sink, search = ListSink(), Offsets()
    schedule: dict[int, tuple[str, Any]] = dict.fromkeys((1, 2, 3), ("offsets", search))
    strategy = Malicious(fedsgd(), sink, CARD, "gradient", Selection.parse("all"), Selection.parse("0,1,2"), schedule)
    assert isinstance(search, ClientManipulation)
    models = []
    for round_ in (1, 2, 3):
        instructions = list(
            strategy.configure_train(round_, array_record(NAMES, global_arrays(1)), ConfigRecord(), Nodes(4))
        )
        received = {m.metadata.dst_node_id: m.content["arrays"].to_numpy_ndarrays() for m in instructions}
        models.append(received)
        replies = [  # node 100 + c is client c; it uploads what it received times the round
            reply(m, [a * round_ for a in arrays[:2]] + arrays[2:], 8, {"client": node - 100, "batch-size": 8})
            for m in instructions
            for node, arrays in [(m.metadata.dst_node_id, received[m.metadata.dst_node_id])]
        ]
        aggregated, _ = strategy.aggregate_train(round_, replies)
        if round_ < 3:
            assert aggregated is None, "uploads on fished models never reach the model"
    honest = global_arrays(1)
    for node, arrays in models[0].items():
        assert np.array_equal(arrays[0], honest[0] + node), "each node gets its own model, not the last one built"
    assert all(np.array_equal(arrays[0], honest[0]) for arrays in models[2].values()), "searches over: honest"
    derived = [o for o in sink.items if o.manipulation == "offsets"]
    assert sorted(o.client for o in derived) == [0, 1, 2], "client 3 is not targeted"
    for obs in derived:
        node = 100 + obs.client
        assert obs.round == 2 and np.allclose(obs.upload[0], 2 * (honest[0] + node) - (honest[0] + node))
    assert [(o.round, o.manipulation) for o in sink.items if o not in derived] == [(3, "none")] * 3
    assert aggregated is not None and np.allclose(aggregated.to_numpy_ndarrays()[0], honest[0] - 0.1 * 3 * honest[0])


def test_a_search_needs_gradient_uploads() -> None:
    with pytest.raises(ValueError, match=r"\['offsets'\] search across rounds on gradient uploads \(FedSGD\)"):
        Malicious(
            FedAvg(),
            ListSink(),
            CARD,
            "weights",
            Selection.parse("1"),
            Selection.parse("all"),
            {1: ("offsets", Offsets())},
        )
