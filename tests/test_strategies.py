"""The server on Flower's message API, driven in process: the strategy registry, the wrappers, the round guard,
the federation check, and whole runs of ``run_server`` with Flower's built-in strategies and a user's own."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord
from flwr.common.logger import FLOWER_LOGGER
from flwr.serverapp.strategy import FedAvg, FedMedian, Krum

from fedguard.config import ConfigError
from fedguard.report.run_status import read_status
from fedguard.runtime.client_app import make_client_app
from fedguard.runtime.server_app import FederationMismatch, round_accounting, run_server, wait_for_nodes
from fedguard.wire.records import array_record
from strategies import AllClientsFailed, GradientStep, RoundGuard, StrategyContext, build_strategy
from strategies.client_failures import FAILURE_CHARS, ClientFailure
from strategies.fedsgd import FedSGD
from strategies.registry import STRATEGIES, protocol_problem
from strategies.upload_checks import UploadRules
from strategies.wrapper import StrategyWrapper, aggregation_line
from tests.helpers import Nodes, config, reply, train_round
from tests.local_grid import LocalGrid

CONTEXT = StrategyContext(clients_per_round=3, num_clients=3, lr=0.5, trainable=(True, False))
RULES = UploadRules("fedsgd", lr=0.5, batch_size=8, local_epochs=1, num_classes=10, partition_sizes=(8, 8))


def test_every_registered_strategy_builds_for_the_protocols_it_declares() -> None:
    for name in STRATEGIES.names():
        for protocol in ("fedavg", "fedsgd"):
            if protocol_problem(name, protocol) is None:
                assert build_strategy(name, protocol, CONTEXT) is not None


def test_fedprox_is_refused_for_fedsgd_and_fedsgd_for_weights() -> None:
    with pytest.raises(ValueError, match="proximal term has no gradient"):
        build_strategy("fedprox", "fedsgd", CONTEXT)
    with pytest.raises(ConfigError, match="server.strategy = 'fedsgd' aggregates fedsgd uploads only"):
        config("server.strategy=fedsgd", "train.protocol=fedavg")
    with pytest.raises(ConfigError, match="server.fedtrimmedavg: beta = 0.7: must be in"):
        config("server.strategy=fedtrimmedavg", "server.fedtrimmedavg.beta=0.7")


@pytest.mark.parametrize("inner, expected", [(FedAvg, -1.0), (FedMedian, -1.0), (Krum, -0.5)])  # Krum: ties, first
def test_a_model_strategy_runs_fedsgd_through_gradient_step(inner, expected) -> None:
    # Three gradients 1, 2, 3 (equal weights): one step of lr 0.5 from 0 by their mean / median / the central one.
    strategy = GradientStep(inner(min_train_nodes=3, min_available_nodes=3), 0.5, [True, False])
    uploads = [
        ([np.array([float(c + 1)], np.float32), np.array([7.0], np.float32)], 8, {"client": c}) for c in range(3)
    ]
    new, _, _ = train_round(strategy, 1, ["w", "running"], [np.zeros(1, np.float32), np.zeros(1, np.float32)], uploads)
    arrays = new.to_numpy_ndarrays()
    assert arrays[0] == pytest.approx([expected]) and arrays[1] == pytest.approx([7.0])  # a buffer: as uploaded


def test_the_round_guard_stops_a_round_in_which_every_client_failed() -> None:
    seen = []
    guard = RoundGuard(FedAvg(min_train_nodes=2), lambda *a: seen.append(a), RULES)
    sent = list(guard.configure_train(1, array_record(["w"], [np.zeros(2, np.int64)]), ConfigRecord(), Nodes(2)))
    from flwr.app import Error, Message

    errors = []
    for m in sent:
        m.metadata.__dict__["_message_id"] = "m"
        errors.append(Message(Error(code=0, reason="boom"), reply_to=m))
    with pytest.raises(AllClientsFailed, match=r"round 1: every one of 2 clients failed \(client 0 \(node \d+\): boom"):
        guard.aggregate_train(1, errors)
    assert seen[0][1] == [] and [(f.client, f.reason) for f in seen[0][2]] == [(0, "boom"), (1, "boom")]


# The reason Flower relays for a ClientApp that raised in a Ray actor (Flower 1.2x), cut to its last frames.
RAY_REASON = """Traceback (most recent call last):
  File "/venv/flwr/clientapp/client_app.py", line 158, in __call__
    return self._registered_funcs["train"](message, context)
  File "/repo/clients/defended_client.py", line 185, in fit
    sent = grads if every_step else defense(step, defense_state)
  File "/plugins/flaky_defense.py", line 13, in defend
    raise ValueError("the flaky defense broke")
ValueError: the flaky defense broke

The above exception was the direct cause of the following exception:

\x1b[36mray::ClientAppActor.run()\x1b[39m (pid=17733, ip=127.0.0.1, actor_id=5938)
  File "/venv/flwr/simulation/ray_transport/ray_actor.py", line 65, in run
    raise ClientAppException(str(ex)) from ex
flwr.clientapp.client_app.ClientAppException:
Exception ClientAppException occurred. Message: the flaky defense broke'>"""


def test_a_failure_keeps_the_exception_and_where_it_was_raised() -> None:
    failure = ClientFailure.of(4, 17, RAY_REASON)
    assert failure.reason == "ValueError: the flaky defense broke (at /plugins/flaky_defense.py:13 in defend)"
    assert failure.row() == {"client": 4, "node": 17, "reason": failure.reason}
    assert str(ClientFailure.of(None, 9, None)) == "client ? (node 9): no reason given"
    assert ClientFailure.of(1, 2, "\x1b[91mnode went away\x1b[0m").reason == "node went away"  # no traceback: as sent
    long = ClientFailure.of(1, 2, "x" * 5000).reason
    assert len(long) == FAILURE_CHARS + 3 and long.startswith("...")


def test_a_client_that_sends_no_reply_within_the_timeout_is_a_straggler() -> None:
    seen = []
    guard = RoundGuard(FedAvg(min_train_nodes=3), lambda *a: seen.append(a), RULES)
    sent = list(guard.configure_train(1, array_record(["w"], [np.zeros(2, np.float32)]), ConfigRecord(), Nodes(3)))
    from flwr.app import Error, Message

    late = sorted(sent, key=lambda m: m.metadata.dst_node_id)[1]  # client 1's node: no reply by the timeout
    replies = []
    for m in sent:
        m.metadata.__dict__["_message_id"] = "m"
        if m is not late:
            replies.append(Message(Error(code=0, reason="boom"), reply_to=m))
    with pytest.raises(AllClientsFailed):
        guard.aggregate_train(1, replies)
    assert seen[0][5] == [1] and sorted(f.client for f in seen[0][2]) == [0, 2]
    row: dict = {}
    round_accounting(row)(*seen[0])
    assert row["stragglers"] == [1] and row["failures"] == 2


def test_the_round_guard_keeps_integer_buffers_integers() -> None:
    guard = RoundGuard(FedAvg(min_train_nodes=2), lambda *a: None, RULES)
    sent = sorted(
        guard.configure_train(1, array_record(["n"], [np.array(3, np.int64)]), ConfigRecord(), Nodes(2)),
        key=lambda m: m.metadata.dst_node_id,
    )  # clients 0, 1
    new, _ = guard.aggregate_train(
        1, [reply(m, [np.array(c + 4, np.int64)], 8, {"client": c}) for c, m in enumerate(sent)]
    )
    [counter] = new.to_numpy_ndarrays()
    assert counter.dtype == np.int64 and counter.shape == () and int(counter) == 4  # round(4.5) to even


def test_the_federation_check_says_how_to_fix_a_mismatch() -> None:
    cfg = config("server.connect-timeout=0.3")  # 4 clients
    assert wait_for_nodes(Nodes(4), cfg) == 4
    with pytest.raises(
        FederationMismatch,
        match=r"2 SuperNodes are connected after 0 s, but partition.num-clients "
        r"= 4 .*num-supernodes=4.*partition.num-clients=2 "
        r"train.clients-per-round=2",
    ):
        wait_for_nodes(Nodes(2), cfg)
    with pytest.raises(FederationMismatch, match="6 SuperNodes are connected, but"):
        wait_for_nodes(Nodes(6), cfg)


def run_in_process(tmp_path: Path, *overrides: str, fail: tuple[int, ...] = ()) -> Path:
    cfg = config("train.rounds=3", "capture.rounds=none", f"out-dir={tmp_path / 'run'}", *overrides)
    return run_server(LocalGrid(make_client_app(cfg), cfg.partition.num_clients, fail=fail), cfg)


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "overrides",
    [
        ("server.strategy=fedavg",),
        ("server.strategy=fedadam", "server.fedadam.eta=0.05"),
        ("server.strategy=fedprox", "train.protocol=fedavg", "train.lr=0.1", "server.fedprox.proximal-mu=0.1"),
        ("server.strategy=fedmedian", "train.protocol=fedavg", "train.lr=0.1"),
    ],
)
def test_flowers_strategies_train_the_model(tmp_path: Path, overrides: tuple[str, ...]) -> None:
    folder = run_in_process(tmp_path, "train.rounds=4", *overrides)
    loss = [r["loss"] for r in rows(folder)]
    assert len(loss) == 5 and loss[-1] < loss[0] - 0.01, loss
    assert read_status(folder)["status"] == "completed"


@pytest.fixture
def plugin_registry(monkeypatch: pytest.MonkeyPatch):
    """The strategy registry as it is, restored after the test (plugins it imports register into a copy)."""
    import strategies.registry as registry

    monkeypatch.setattr(STRATEGIES, "_entries", dict(STRATEGIES._entries))
    monkeypatch.setattr(registry, "_AGGREGATION", dict(registry._AGGREGATION))
    monkeypatch.delitem(sys.modules, "extensions.norm_clipped", raising=False)
    yield
    sys.modules.pop("extensions.norm_clipped", None)


def test_a_user_strategy_outside_the_package_is_selected_by_configuration(
    tmp_path: Path, plugin_registry, capsys: pytest.CaptureFixture
) -> None:
    folder = run_in_process(
        tmp_path,
        "server.plugins=extensions.norm_clipped",
        "server.strategy=norm-clipped-fedavg",
        "server.norm-clipped-fedavg.clip=0.05",
    )
    assert "norm-clipped-fedavg: round 3: 3 of 3 uploads clipped to 0.05" in capsys.readouterr().out
    assert read_status(folder)["status"] == "completed" and len(rows(folder)) == 4


def test_a_failed_client_is_counted_and_a_round_without_any_stops_the_run(tmp_path: Path) -> None:
    folder = run_in_process(tmp_path / "one", "train.clients-per-round=4", fail=(1,))
    assert [r.get("failures") for r in rows(folder)[1:]] == [1, 1, 1] and rows(folder)[1]["clients"] == 3
    assert [[(f["client"], f["reason"]) for f in r["failed"]] for r in rows(folder)[1:]] == [
        [(1, "RuntimeError: this client fails")]
    ] * 3, "each failure is recorded with its client and reason"
    with pytest.raises(AllClientsFailed):
        run_in_process(tmp_path / "all", fail=(0, 1, 2, 3))
    status = read_status(tmp_path / "all" / "run")
    assert status["status"] == "failed" and "every one of 3 clients failed" in status["error"]


def test_no_module_uses_flowers_legacy_server_or_filters_its_warnings() -> None:
    import ast
    import re

    root = Path(__file__).resolve().parents[1]
    legacy = ("flwr.server.compat", "flwr.server.strategy", "flwr.common.FitRes")
    # The deprecated Python entry of the simulation; the engine under it, which Flower's own `flwr-simulation`
    # process runs (`_run_simulation`), is what the warm runner calls.
    deprecated = {"flwr.simulation.run_simulation", "flwr.simulation.run_simulation.run_simulation"}
    for folder in ("fedguard", "clients", "strategies", "attackers", "extensions"):
        for source in (root / folder).rglob("*.py"):
            text = source.read_text()
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                    imported = names[1:]
                elif isinstance(node, ast.Import):
                    names = imported = [a.name for a in node.names]
                else:
                    continue
                assert not any(n.startswith(legacy) for n in names), f"{source} imports {names}"
                assert not deprecated.intersection(imported), f"{source} imports {imported}"
            flower_filter = re.search(r"filterwarnings\([^)]*(flwr|[Ff]lower)|getLogger\([\"']flwr|addFilter", text)
            assert flower_filter is None, f"{source} filters Flower's warnings"


def test_the_summary_names_the_strategy_that_aggregates_and_how_it_weighs(caplog: pytest.LogCaptureFixture) -> None:
    fedsgd = StrategyWrapper(FedSGD(lr=0.5, trainable=[True]))
    assert aggregation_line(fedsgd) == (
        "FedSGD(lr=0.5) aggregates (the uniform mean of the gradients, then theta -= 0.5 * mean; buffers averaged), "
        "behind StrategyWrapper"
    )
    flower = StrategyWrapper(StrategyWrapper(FedAvg()))
    assert aggregation_line(flower) == (
        "FedAvg aggregates (mean weighted by 'num-examples'), behind StrategyWrapper > StrategyWrapper"
    )
    FLOWER_LOGGER.propagate = True
    try:
        with caplog.at_level(logging.INFO):
            fedsgd.summary()
    finally:
        FLOWER_LOGGER.propagate = False
    assert "FedSGD(lr=0.5) aggregates (the uniform mean" in caplog.text and "Weighted by" not in caplog.text
