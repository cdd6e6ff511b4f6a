"""The malicious wrapper: sends manipulated models in scheduled rounds, records them, keeps the honest model."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.strategy import FedAvg

from fedguard.observation import ModelCard
from fedguard.selection import Selection
from strategies import FedSGD, HonestButCurious, Malicious
from tests.helpers import fit_res
from tests.test_capture import CARD, ListSink, _Sampler, global_arrays


def doubled(arrays: list[np.ndarray], card: ModelCard, rng: np.random.Generator) -> list[np.ndarray]:
    """A manipulation for the tests: doubles the first array and adds a seeded draw to the second."""
    return [arrays[0] * 2, (arrays[1] + rng.normal(size=arrays[1].shape)).astype(arrays[1].dtype), arrays[2]]


def results(round_: int, base: list[np.ndarray]) -> list:
    """Four uploads: ``base`` moved by a client-specific amount (as weights) or that amount (as gradients)."""
    return [(None, fit_res([base[0] - c, base[1] - c, base[2]], 8, {"client": c, "batch-size": 8, "lr": 0.1}))
            for c in range(4)]


def play(strategy, round_: int, uploads_from_sent: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One round; returns (arrays the clients received, the new global arrays)."""
    instructions = strategy.configure_fit(round_, ndarrays_to_parameters(global_arrays(round_)), _Sampler())
    received = [parameters_to_ndarrays(ins.parameters) for _, ins in instructions]
    assert all(all(np.array_equal(a, b) for a, b in zip(r, received[0])) for r in received), "clients differ"
    base = received[0] if uploads_from_sent else [np.zeros_like(a) for a in received[0]]
    params, _ = strategy.aggregate_fit(round_, results(round_, base), [])
    return received[0], parameters_to_ndarrays(params)


def test_scheduled_rounds_send_the_manipulated_model_and_captures_record_it() -> None:
    sink = ListSink()
    strategy = Malicious(FedSGD(lr=0.1, trainable=[True, True, False]), sink, CARD, "gradient",
                         Selection.parse("1,2"), Selection.parse("all"), {2: ("double", doubled)}, seed=5)
    honest_received, _ = play(strategy, 1, uploads_from_sent=False)
    sent, _ = play(strategy, 2, uploads_from_sent=False)
    assert all(np.array_equal(a, b) for a, b in zip(honest_received, global_arrays(1)))
    expected = doubled(global_arrays(2), CARD, np.random.default_rng(np.random.SeedSequence([5, 2])))
    assert all(np.array_equal(a, b) for a, b in zip(sent, expected))
    assert [(o.round, o.manipulation) for o in sink.items] == [(1, "none")] * 4 + [(2, "double")] * 4
    assert all(np.array_equal(a, b) for a, b in zip(sink.items[-1].global_arrays, expected))


def test_fedsgd_steps_from_the_honest_model_with_the_clients_gradients() -> None:
    malicious = Malicious(FedSGD(lr=0.1, trainable=[True, True, False]), ListSink(), CARD, "gradient",
                          Selection.parse("1"), Selection.parse("all"), {1: ("double", doubled)})
    honest = HonestButCurious(FedSGD(lr=0.1, trainable=[True, True, False]), ListSink(), CARD, "gradient",
                              Selection.parse("1"), Selection.parse("all"))
    _, got = play(malicious, 1, uploads_from_sent=False)
    _, want = play(honest, 1, uploads_from_sent=False)
    assert all(np.allclose(a, b) for a, b in zip(got, want))


def test_fedavg_applies_the_clients_change_to_the_honest_model() -> None:
    strategy = Malicious(FedAvg(), ListSink(), CARD, "weights", Selection.parse("1"), Selection.parse("all"),
                         {1: ("double", doubled)})
    _, got = play(strategy, 1, uploads_from_sent=True)
    mean_change = -np.mean(np.arange(4))  # client c uploads sent - c
    honest = global_arrays(1)
    assert np.allclose(got[0], honest[0] + mean_change) and np.allclose(got[1], honest[1] + mean_change)
    assert all(g.dtype == h.dtype and g.shape == h.shape for g, h in zip(got, honest))


def test_a_manipulation_that_changes_the_layout_is_refused() -> None:
    def reshaped(arrays, card, rng):
        return [arrays[0].reshape(-1), *arrays[1:]]

    strategy = Malicious(FedAvg(), ListSink(), CARD, "weights", Selection.parse("1"), Selection.parse("all"),
                         {1: ("reshape", reshaped)})
    with pytest.raises(ValueError, match="'reshape' changed the model's layout"):
        play(strategy, 1, uploads_from_sent=True)
