"""The defended client: seeded batches, the defense hook, state across rounds, both protocols."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg

from clients import DefendedClient
from clients.state import load_defense_state, store_defense_state
from fedguard.data import load_dataset
from fedguard.data.federated import client_split
from fedguard.defenses import LocalStep, RoundReports, aggregate_reports
from fedguard.models import build_model
from fedguard.runtime.client_app import make_client_app, partition_of
from fedguard.seeding import client_generators
from fedguard.training import compute_gradients, get_arrays, local_sgd, parameters, trainable_mask
from fedguard.wire.records import array_record
from strategies import SparseUploads
from tests.helpers import Nodes, client_fit, config, context, reply
from tests.local_grid import LocalGrid


def start_arrays(cfg) -> list[np.ndarray]:
    torch.manual_seed(0)
    return get_arrays(build_model(cfg.model.name, load_dataset(cfg.data.name).spec, cfg.model.params))


def test_fedsgd_upload_is_the_gradient_of_the_seeded_batch() -> None:
    cfg = config()
    arrays = start_arrays(cfg)
    upload, n, metrics = client_fit(cfg, 2, arrays, round_=5)
    rng, _ = client_generators(cfg.run.seed, 2, 5)
    local = client_split("digits", cfg.data.source_options(), "iid", cfg.partition.options(), 4, cfg.run.seed, 2)
    x, y = local.batch(rng.choice(len(local), size=8, replace=False))
    model = build_model("mlp", load_dataset("digits").spec, cfg.model.params)
    model.load_state_dict({k: torch.from_numpy(a) for k, a in zip(model.state_dict(), arrays)})
    grads, loss = compute_gradients(model, x, y)
    assert n == 8 and metrics["client"] == 2 and metrics["batch-size"] == 8 and metrics["loss"] == pytest.approx(loss)
    for got, want in zip(upload, grads):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)


def test_randomness_depends_on_seed_client_round_only() -> None:
    cfg = config()
    arrays = start_arrays(cfg)
    first, _, _ = client_fit(cfg, 1, arrays, round_=3)
    again, _, _ = client_fit(cfg, 1, arrays, round_=3)
    other_round, _, _ = client_fit(cfg, 1, arrays, round_=4)
    other_client, _, _ = client_fit(cfg, 0, arrays, round_=3)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(first[0], other_round[0]) and not np.array_equal(first[0], other_client[0])


class CountingDefense:
    """Adds the number of rounds seen so far to every gradient; remembers the count in state."""

    def __init__(self) -> None:
        self.steps: list[LocalStep] = []

    def __call__(self, step: LocalStep, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        self.steps.append(step)
        state["count"] = state.get("count", torch.zeros(())) + 1
        return [g + state["count"] for g in step.grads]


def test_defense_sees_the_step_and_its_state_survives_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config()
    arrays = start_arrays(cfg)
    raw, _, _ = client_fit(cfg, 0, arrays, round_=1)  # undefended
    defense = CountingDefense()
    monkeypatch.setattr("clients.defended_client._defense", lambda name, params: defense)
    state = RecordDict()
    first, _, _ = client_fit(cfg, 0, arrays, round_=1, state=state)
    second, _, _ = client_fit(cfg, 0, arrays, round_=1, state=state)  # a new client object, same Context.state
    np.testing.assert_allclose(first[0], raw[0] + 1, rtol=1e-6)
    np.testing.assert_allclose(second[0], raw[0] + 2, rtol=1e-6)
    assert float(load_defense_state(state)["count"]) == 2
    step = defense.steps[-1]
    assert step.round == 1 and step.client == 0 and step.x.shape == (8, 1, 8, 8)
    # The defense gets the model at the global parameters.
    assert all(np.array_equal(p.detach().numpy(), a) for p, a in zip(parameters(step.model), arrays))


class ReportingCounter(CountingDefense):
    """CountingDefense that reports its count."""

    def report(self, state: dict[str, torch.Tensor]) -> dict[str, float]:
        return {"count": float(state["count"])}


def test_defense_reports_travel_as_fit_metrics_and_aggregate_to_the_largest(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config()
    arrays = start_arrays(cfg)
    monkeypatch.setattr("clients.defended_client._defense", lambda name, params: ReportingCounter())
    state = RecordDict()
    _, _, first = client_fit(cfg, 0, arrays, round_=1, state=state)
    _, _, second = client_fit(cfg, 0, arrays, round_=2, state=state)
    _, _, other = client_fit(cfg, 1, arrays, round_=2)
    assert first["defense.count"] == 1.0 and second["defense.count"] == 2.0 and other["defense.count"] == 1.0
    assert aggregate_reports([second, other, {"loss": 9.0}]).totals == {"count": 2.0}
    assert aggregate_reports([{"loss": 1.0}]) == RoundReports({}, [])
    monkeypatch.undo()
    _, _, plain = client_fit(config(), 0, arrays, round_=1)
    assert not any(key.startswith("defense.") for key in plain)


def test_per_upload_reports_are_kept_per_client_and_averaged() -> None:
    metrics = [
        {"client": 3, "defense.upload.raw": 1.0, "defense.upload.norm": 2.0, "defense.steps": 4.0},
        {"client": 5, "defense.upload.raw": 0.0, "defense.upload.norm": 6.0, "defense.steps": 7.0},
        {"client": 6, "loss": 1.0},
    ]
    reports = aggregate_reports(metrics)
    assert reports.uploads == [{"client": 3, "raw": 1.0, "norm": 2.0}, {"client": 5, "raw": 0.0, "norm": 6.0}]
    assert reports.totals == {"steps": 7.0, "raw": 0.5, "norm": 4.0}


def test_fedavg_uploads_locally_trained_weights() -> None:
    cfg = config("train.protocol=fedavg", "train.local-epochs=2", "train.lr=0.05")
    arrays = start_arrays(cfg)
    upload, n, metrics = client_fit(cfg, 3, arrays, round_=2)
    local = client_split("digits", cfg.data.source_options(), "iid", cfg.partition.options(), 4, cfg.run.seed, 3)
    model = build_model("mlp", load_dataset("digits").spec, cfg.model.params)
    model.load_state_dict({k: torch.from_numpy(a) for k, a in zip(model.state_dict(), arrays)})
    rng, _ = client_generators(cfg.run.seed, 3, 2)
    x, y = local.batch()
    steps, _ = local_sgd(model, x, y, 0.05, 2, 8, rng)
    assert n == len(local) and metrics["local-steps"] == steps == 2 * int(np.ceil(len(local) / 8))
    for got, want in zip(upload, get_arrays(model)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_batchnorm_buffers_travel_with_the_gradient() -> None:
    cfg = config("model.name=convnet", "model.convnet.width=2", "data.name=lfw-faces")
    arrays = start_arrays(cfg)
    upload, _, _ = client_fit(cfg, 0, arrays, round_=1)
    mask = trainable_mask(build_model("convnet", load_dataset("lfw-faces").spec, cfg.model.params))
    moved = [not np.array_equal(u, a) for u, a, m in zip(upload, arrays, mask) if not m]
    assert any(moved), "running statistics of the local batch should be uploaded"


def test_state_record_round_trip() -> None:
    state = RecordDict()
    store_defense_state(state, {"residual": torch.arange(6.0).reshape(2, 3)})
    assert torch.equal(load_defense_state(state)["residual"], torch.arange(6.0).reshape(2, 3))
    store_defense_state(state, {})
    assert load_defense_state(state) == {}


def test_partition_of_checks_node_config() -> None:
    cfg = config()
    assert partition_of(context(3, 4), cfg) == 3
    with pytest.raises(ValueError, match="num-partitions=5"):
        partition_of(context(3, 5), cfg)
    bad = context(0, 4)
    bad.node_config.clear()
    with pytest.raises(ValueError, match="--node-config"):
        partition_of(bad, cfg)


def test_the_client_app_replies_with_typed_records_read_from_the_run_config() -> None:
    cfg = config("threat.labels=true", "defense.name=dp", "train.protocol=fedavg")
    model = build_model(cfg.model.name, load_dataset(cfg.data.name).spec, cfg.model.params)
    grid = LocalGrid(make_client_app(None), 4)
    for ctx in grid.contexts.values():
        ctx.run_config.update(dict(cfg.to_flat()))
    strategy = FedAvg(min_train_nodes=4)
    names, arrays = list(model.state_dict()), get_arrays(model)
    messages = strategy.configure_train(1, array_record(names, arrays), ConfigRecord(), grid)
    replies = sorted(grid.send_and_receive(messages), key=lambda m: m.metadata.src_node_id)
    assert not any(m.has_error() for m in replies)
    content = replies[2].content
    assert isinstance(content["arrays"], ArrayRecord) and list(content["arrays"].keys()) == names
    assert isinstance(content["metrics"], MetricRecord) and set(content["metrics"]) == {"num-examples", "loss"}
    declared = content["declared"]
    assert declared["client"] == 2 and declared["protocol"] == "fedavg" and declared["local-epochs"] == 1
    assert isinstance(declared["labels"], list) and len(declared["labels"]) == content["metrics"]["num-examples"]
    assert content["defense"] and all(k.startswith("defense.") for k in content["defense"])


def test_the_reply_holds_the_clients_typed_reply_and_fit_returns_its_flat_form() -> None:
    cfg = config("defense.name=dp", "detect.name=structure", "threat.labels=true")
    arrays = start_arrays(cfg)
    names = [f"entry-{i}" for i in range(len(arrays))]
    answer = DefendedClient(cfg, 1, RecordDict()).round_reply(arrays, {"server-round": 1})
    assert answer.declared.client == 1 and answer.declared.labels is not None
    assert answer.reports and all(k.startswith("defense.") for k in answer.reports)
    assert answer.findings and answer.findings["flagged"] == 0.0  # a fresh model: nothing to act on
    content = answer.content(names)
    assert list(content["arrays"].keys()) == names
    assert dict(content["declared"]) == answer.declared.record()
    assert dict(content["defense"]) == dict(answer.reports) and dict(content["detect"]) == dict(answer.findings)
    upload, examples, metrics = DefendedClient(cfg, 1, RecordDict()).fit(arrays, {"server-round": 1})
    assert all(np.array_equal(a, b) for a, b in zip(upload, answer.upload)) and examples == answer.num_examples
    assert metrics == answer.metrics() and metrics["detect.flagged"] == 0.0


def test_fedprox_proximal_term_reaches_the_clients_local_training() -> None:
    cfg = config("train.protocol=fedavg", "train.local-epochs=3", "train.lr=0.5")
    arrays = start_arrays(cfg)
    plain, _, declared_plain = client_fit(cfg, 0, arrays, round_=1)
    prox, _, declared = client_fit(cfg, 0, arrays, round_=1, **{"proximal-mu": 1.0})
    distance = [
        sum(float(np.sum((u - a) ** 2)) for u, a, m in zip(up, arrays, mask) if m)
        for up, mask in ((plain, trainable_mask_of(cfg)), (prox, trainable_mask_of(cfg)))
    ]
    assert distance[1] < 0.8 * distance[0], "the proximal term keeps the local model closer to the global one"
    assert declared["proximal-mu"] == 1.0 and "proximal-mu" not in declared_plain


def trainable_mask_of(cfg) -> list[bool]:
    return trainable_mask(build_model(cfg.model.name, load_dataset(cfg.data.name).spec, cfg.model.params))


def test_a_client_outside_the_partitions_is_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        DefendedClient(config(), 4, RecordDict())


def test_labels_are_declared_only_when_the_threat_model_grants_them() -> None:
    cfg = config()
    arrays = start_arrays(cfg)
    _, _, hidden = client_fit(cfg, 0, arrays, round_=1)
    _, _, shown = client_fit(config("threat.labels=true"), 0, arrays, round_=1)
    assert "labels" not in hidden
    rng, _ = client_generators(cfg.run.seed, 0, 1)
    local = client_split("digits", cfg.data.source_options(), "iid", cfg.partition.options(), 4, cfg.run.seed, 0)
    _, y = local.batch(rng.choice(len(local), size=8, replace=False))
    assert shown["labels"] == y.tolist()


def test_pruned_uploads_travel_coordinate_encoded_and_decode_exactly() -> None:
    cfg = config("defense.name=dgp")
    arrays = start_arrays(cfg)
    upload, _, metrics = client_fit(cfg, 0, arrays, round_=1)
    assert metrics["encoding"] == "sparse" and metrics["upload-bytes"] < 0.5 * metrics["dense-bytes"]
    assert metrics["upload-bytes"] == sum(a.nbytes for a in upload)
    names = [f"a{i}" for i in range(len(arrays))]
    zeros = [np.zeros_like(a) for a in arrays]
    seen = []

    class Spy(FedAvg):
        def aggregate_train(self, server_round, replies):
            seen.extend(replies)
            return super().aggregate_train(server_round, replies)

    strategy = SparseUploads(Spy(min_train_nodes=1, min_available_nodes=1))
    sent = list(strategy.configure_train(1, array_record(names, zeros), ConfigRecord(), Nodes(1)))
    strategy.aggregate_train(1, [reply(sent[0], upload, 8, metrics)])
    assert "encoding" not in seen[0].content["declared"]
    assert list(seen[0].content["arrays"].keys()) == names
    dense = seen[0].content["arrays"].to_numpy_ndarrays()
    assert [a.shape for a in dense] == [a.shape for a in arrays]
    assert sum(int((a != 0).sum()) for a in dense) < 0.3 * sum(a.size for a in dense)
    _, _, plain = client_fit(config(), 0, arrays, round_=1)
    assert "encoding" not in plain and plain["upload-bytes"] == plain["dense-bytes"]
