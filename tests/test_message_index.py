"""The per-node message index gives every node the messages Flower's own lookup gives it, in the same order."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import HEARTBEAT_INTERVAL_INF, NOOP_ACCOUNT_NAME, NOOP_FLWR_AID, SUPERLINK_NODE_ID
from flwr.proto.task_pb2 import Task  # pylint: disable=no-name-in-module
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState, RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid

from fedguard.runtime.message_index import index_message_delivery, remove_message_index


@pytest.fixture(autouse=True)
def server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages built here come from the server (Flower's ``Message`` reads its sender from ``TaskIdentity``)."""
    for name in ("_node_id", "_run_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, getattr(TaskIdentity, name))  # restored after the test
    TaskIdentity.node_id = SUPERLINK_NODE_ID


@pytest.fixture
def indexed() -> Iterator[None]:
    assert index_message_delivery()
    try:
        yield
    finally:
        remove_message_index()


def simulation_state(nodes: int) -> tuple[InMemoryLinkState, InMemoryGrid, list[int]]:
    """A fresh in-memory state set up as Flower's simulation sets it up: one run, ``nodes`` online nodes."""
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    state = factory.state()
    run = Run.create_empty(run_id=secrets.randbelow(2**62) + 1)
    run.primary_task_id = secrets.randbelow(2**62) + 1
    run.federation_id = NOOP_FEDERATION_ID
    state.run_ids[run.run_id] = RunRecord(run=run)
    state.task_store[run.primary_task_id] = Task(task_id=run.primary_task_id, run_id=run.run_id)
    TaskIdentity.run_id, TaskIdentity.task_id = run.run_id, run.primary_task_id
    node_ids = []
    for _ in range(nodes):
        node_id = state.create_node(
            NOOP_FLWR_AID, NOOP_ACCOUNT_NAME, secrets.token_bytes(32), heartbeat_interval=HEARTBEAT_INTERVAL_INF
        )
        state.acknowledge_node_heartbeat(node_id=node_id, heartbeat_interval=HEARTBEAT_INTERVAL_INF)
        node_ids.append(node_id)
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    return state, grid, node_ids


def push(grid: InMemoryGrid, node_ids: list[int], plan: list[tuple[int, str, float]]) -> None:
    """Push one message per (node index, tag, ttl seconds) of ``plan``, in order."""
    grid.push_messages(
        [
            Message(RecordDict({"tag": ConfigRecord({"tag": tag})}), node_ids[node], "train", ttl=ttl, group_id="1")
            for node, tag, ttl in plan
        ]
    )


def deliveries(state: InMemoryLinkState, node_ids: list[int], ticks: int, limit: int | None) -> list[list[str]]:
    """The tags each tick of Flower's simulation loop (every node asked in turn) hands out."""
    return [
        [
            str(message.content["tag"]["tag"])
            for node in node_ids
            for message in state.get_message_ins(node_id=node, limit=limit)
        ]
        for _ in range(ticks)
    ]


PLAN = [(0, "a0", 3600.0), (1, "b0", 3600.0), (0, "a1", 3600.0), (2, "c0", 0.05), (3, "d0", 3600.0), (0, "a2", 3600.0)]


def scenario(limit: int | None) -> list[list[str]]:
    state, grid, node_ids = simulation_state(4)
    push(grid, node_ids, PLAN)
    time.sleep(0.1)  # c0 expires
    first = deliveries(state, node_ids, 2, limit)
    push(grid, node_ids, [(1, "b1", 3600.0), (3, "d1", 3600.0)])
    return first + deliveries(state, node_ids, 3, limit)


@pytest.mark.parametrize("limit", [1, None])
def test_nodes_get_what_flowers_lookup_gives_them(limit: int | None, request: pytest.FixtureRequest) -> None:
    flower = scenario(limit)
    request.getfixturevalue("indexed")
    assert scenario(limit) == flower
    if limit == 1:
        assert flower == [["a0", "b0", "d0"], ["a1"], ["a2", "b1", "d1"], [], []]


def test_delivered_messages_are_stamped_and_kept_until_their_replies(indexed: None) -> None:
    state, grid, node_ids = simulation_state(2)
    push(grid, node_ids, [(0, "a0", 3600.0), (1, "b0", 3600.0)])
    (message,) = state.get_message_ins(node_id=node_ids[1], limit=1)
    assert message.metadata.delivered_at != ""
    assert message.metadata.message_id in state.message_ins_store
    assert state.get_message_ins(node_id=node_ids[1], limit=1) == []


def test_messages_of_another_run_wait_for_their_run(indexed: None) -> None:
    state, grid, node_ids = simulation_state(1)
    push(grid, node_ids, [(0, "a0", 3600.0)])
    run_id = grid.run.run_id
    assert state.get_message_ins(node_id=node_ids[0], limit=1, run_id=run_id + 1) == []
    (message,) = state.get_message_ins(node_id=node_ids[0], limit=1, run_id=run_id)
    assert message.content["tag"]["tag"] == "a0"


def test_a_bad_limit_is_refused_as_flower_refuses_it(indexed: None) -> None:
    state, _, node_ids = simulation_state(1)
    with pytest.raises(AssertionError, match="limit"):
        state.get_message_ins(node_id=node_ids[0], limit=0)


def test_another_flower_version_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    import flwr

    monkeypatch.setattr(flwr, "__version__", "0.0.0")
    original = InMemoryLinkState.get_message_ins
    assert not index_message_delivery()
    assert InMemoryLinkState.get_message_ins is original
