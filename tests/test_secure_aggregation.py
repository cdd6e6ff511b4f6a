"""Secure aggregation (threat.aggregation = 'secure'): the server sees one aggregate a round, equal to what FedAvg
aggregates, scored against every client's batch; attacks that cannot read an aggregate are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.serverapp.strategy import FedAvg

from fedguard.aggregate import AGGREGATE_CLIENT, AGGREGATE_KEY, aggregate_declaration, weighted_mean
from fedguard.config import ConfigError, load_config
from fedguard.evaluation import Evaluator
from fedguard.selection import Selection
from fedguard.store.folder import VAULT_DIR
from fedguard.store.vault import read_truth, write_truth
from fedguard.wire.declared import Declared
from strategies import HonestButCurious
from tests.helpers import ListSink, train_round
from tests.test_capture import CARD, NAMES, global_arrays

COUNTS = (8, 3, 5)


def uploads(round_: int) -> list:
    rng = np.random.default_rng(round_)
    return [
        (
            [
                rng.normal(size=(2, 4)).astype(np.float32),
                rng.normal(size=2).astype(np.float32),
                np.array(round_ + c, np.int64),
            ],
            count,
            {"client": 2 * c, "batch-size": 8, "lr": 0.1, "local-epochs": 2, "loss": 0.3 + c},
        )
        for c, count in enumerate(COUNTS)
    ]


def test_the_server_sees_one_aggregate_a_round_equal_to_fedavgs() -> None:
    sink = ListSink()
    inner = FedAvg(min_train_nodes=3, min_available_nodes=3)
    wrapped = HonestButCurious(inner, sink, CARD, "weights", Selection.parse("1,2"), Selection.parse("all"), 1, True)
    for r in (1, 2, 3):
        aggregated, _, _ = train_round(wrapped, r, NAMES, global_arrays(r), uploads(r))
        assert aggregated is not None
        if r < 3:
            obs = sink.items[-1]
            fedavg = aggregated.to_numpy_ndarrays()
            assert all(np.allclose(a, b, rtol=1e-6) for a, b in zip(obs.upload[:2], fedavg[:2]))
    assert [(o.round, o.client) for o in sink.items] == [(1, AGGREGATE_CLIENT), (2, AGGREGATE_CLIENT)]
    obs = sink.items[0]
    assert obs.num_examples == sum(COUNTS) and obs.kind == "weights"
    assert obs.declared.record() == {AGGREGATE_KEY: [0, 2, 4], "lr": 0.1, "local-epochs": 2, "batch-size": 8}
    weights = np.array(COUNTS) / sum(COUNTS)
    assert np.allclose(obs.upload[0], sum(w * u[0][0].astype(np.float64) for w, u in zip(weights, uploads(1))))
    assert obs.upload[2] == round(sum(w * (1 + c) for c, w in enumerate(weights))) and obs.upload[2].dtype == np.int64


def test_a_fedsgd_aggregate_declares_the_union_batch_and_keeps_only_shared_values() -> None:
    declared = [Declared(batch_size=4, lr=0.5, loss=1.0), Declared(batch_size=2, lr=0.5)]
    assert aggregate_declaration([3, 1], declared, [4, 2], one_batch=True).record() == {
        AGGREGATE_KEY: [3, 1],
        "lr": 0.5,
        "batch-size": 6,
    }
    assert aggregate_declaration([3, 1], declared, [4, 2], one_batch=False).record() == {
        AGGREGATE_KEY: [3, 1],
        "lr": 0.5,
    }
    mean = weighted_mean([[np.ones(3, np.float32)], [np.zeros(3, np.float32)]], [1, 3])
    assert mean[0].dtype == np.float32 and np.allclose(mean[0], 0.25)


def test_the_aggregate_is_scored_against_every_clients_batch_in_order(tmp_path: Path) -> None:
    vault = tmp_path / VAULT_DIR
    batches = {c: (torch.rand(n, 1, 2, 2), torch.arange(n) % 2) for c, n in ((0, 2), (2, 1), (4, 3))}
    for client, (images, labels) in batches.items():
        write_truth(vault, 1, client, images, labels)
    obs = CARD.observe(
        1, AGGREGATE_CLIENT, "weights", global_arrays(1), global_arrays(1), 6, {AGGREGATE_KEY: [4, 0, 2]}
    )
    truth = Evaluator(tmp_path, {})._truth(obs)
    assert truth is not None
    order = [batches[4], batches[0], batches[2]]
    assert torch.equal(truth[0], torch.cat([images for images, _ in order]))
    assert torch.equal(truth[1], torch.cat([labels for _, labels in order]))
    stored = read_truth(vault, 1, AGGREGATE_CLIENT)
    assert stored is not None and torch.equal(stored[0], truth[0]), "the report reads it by the aggregate's id"
    (vault / "round-0001_client-0002.npz").unlink()
    assert Evaluator(tmp_path, {})._truth(obs) is None


def test_attacks_that_cannot_read_an_aggregate_and_partial_captures_are_refused() -> None:
    fedavg = ["threat.aggregation=secure", "train.protocol=fedavg"]
    with pytest.raises(ConfigError) as caught:
        load_config(None, [*fedavg, "attack.name=ig,fc-span"])
    [problem] = caught.value.problems
    assert problem.startswith("attack 'ig' cannot attack a secure aggregate of weights uploads")
    assert "those that can: fc-span, imprint" in problem
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["threat.aggregation=secure", "capture.clients=0-1"])
    assert "set capture.clients = 'all' (got '0-1')" in caught.value.problems[0]
    config = load_config(None, ["threat.aggregation=secure", "attack.name=ig,dlg,fc-span"])  # FedSGD: the union
    assert config.threat.model() == "honest, secure aggregation"


def aggregate_run(tmp_path: Path) -> Path:
    """A FedSGD run folder under secure aggregation: two clients' batches of 4 digits, one aggregate captured."""

    from fedguard.data import load_dataset
    from fedguard.store.card import initial_model, model_card
    from fedguard.store.folder import OBSERVATIONS_DIR
    from fedguard.store.observation_files import save_observation
    from fedguard.store.run_dir import prepare_run_dir
    from fedguard.training import compute_gradients, get_arrays, merge_by_mask, split_by_mask, trainable_mask

    overrides = [f"out-dir={tmp_path / 'run'}", "model.mlp.hidden=64", "threat.aggregation=secure"]
    config = load_config(None, [*overrides, "train.batch-size=4", "attack.name=fc-span"])
    folder = prepare_run_dir(config)
    data = load_dataset("mnist-5k")
    model = initial_model(config)  # the run's round-0 model, seed 0
    arrays, mask = get_arrays(model), trainable_mask(model)
    card = model_card(config, model)
    uploads, declared = [], []
    for client in (0, 1):
        x, y = data.test.batch(list(range(4 * client, 4 * client + 4)))
        grads, _ = compute_gradients(model, x, y)
        uploads.append(merge_by_mask([g.numpy() for g in grads], split_by_mask(arrays, mask)[1], mask))
        declared.append(Declared(batch_size=4, lr=config.train.lr))
        write_truth(folder / VAULT_DIR, 1, client, x, y)
    summed = aggregate_declaration([0, 1], declared, [4, 4], one_batch=True)
    obs = card.observe(1, AGGREGATE_CLIENT, "gradient", arrays, weighted_mean(uploads, [4, 4]), 8, summed)
    save_observation(obs, folder / OBSERVATIONS_DIR)
    (folder / "rounds.jsonl").write_text('{"round": 0, "accuracy": 0.1, "loss": 2.3, "seconds": 0.1}\n')
    return folder


def test_fedguard_attack_reads_an_aggregate_back_and_scores_it_against_the_union(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from fedguard.commands.cli import main
    from fedguard.store.folder import ATTACKS_FILE

    folder = aggregate_run(tmp_path)
    assert main(["attack", str(folder), "--set", "attack.name=fc-span"]) == 0
    [row] = [json.loads(line) for line in (folder / ATTACKS_FILE).read_text().splitlines()]
    assert (row["client"], row["batch_size"], len(row["per_image"])) == (AGGREGATE_CLIENT, 8, 8)
    assert row["leaked_images"] >= 6, row["per_image"]  # the FedSGD aggregate: the gradient of the union batch
    capsys.readouterr()


def test_an_aggregate_naming_clients_the_run_does_not_have_is_skipped_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import dataclasses

    from fedguard.commands.cli import main
    from fedguard.store.folder import OBSERVATIONS_DIR
    from fedguard.store.observation_files import load_observations, save_observation

    folder = aggregate_run(tmp_path)
    [obs] = load_observations(folder / OBSERVATIONS_DIR)
    bad = dataclasses.replace(obs, declared=obs.declared.with_fields(extra={AGGREGATE_KEY: [0, 0]}))
    save_observation(bad, folder / OBSERVATIONS_DIR)
    assert main(["attack", str(folder), "--set", "attack.name=fc-span"]) == 2
    out = capsys.readouterr().out
    assert f"declared {AGGREGATE_KEY} = [0, 0]: expected distinct client ids below 10" in out
