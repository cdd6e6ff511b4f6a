"""Builders shared by the tests: configs, clients and Flower result objects."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from clients import DefendedClient
from fedguard.config import Config, load_config
from fedguard.data import DataSpec
from fedguard.data.local import DEBIAN_FASHION_MNIST
from fedguard.defenses.base import REPORT_PREFIX
from fedguard.observation import ModelCard, Observation
from fedguard.training import trainable_mask
from fedguard.wire.records import ARRAYS, ROUND_KEY, array_record, encoded_names, reply_content
from fedguard.wire.sparse import ENCODING_KEY, SPARSE
from tests.commands import SMALL_RUN

FASHION_MNIST = (DEBIAN_FASHION_MNIST / "t10k-images-idx3-ubyte.gz").is_file()
needs_fashion_mnist = pytest.mark.skipif(
    not FASHION_MNIST,
    reason="Debian package dataset-fashion-mnist not installed (.ci/run installs it where apt-get may)",
)


def config(*overrides: str) -> Config:
    """A small config on scikit-learn digits with an MLP, plus ``key=value`` overrides."""
    return load_config(None, [*SMALL_RUN, *overrides])


@contextmanager
def attacker_ray_cluster() -> Iterator[None]:
    """A local Ray cluster of 2 CPUs with the ``attacker`` resource, shut down after the block (one left by an
    earlier test is shut down first)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        resources={"attacker": 2},
        object_store_memory=256 * 1024 * 1024,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


def card_of(model: torch.nn.Module, name: str, spec: DataSpec, params: dict[str, Any] | None = None) -> ModelCard:
    """The model card of ``model``, registered as ``name`` with ``params``, on data of ``spec``."""
    return ModelCard(name, params or {}, spec, tuple(model.state_dict()), tuple(trainable_mask(model)))


def context(partition_id: int, num_partitions: int) -> Context:
    """A SuperNode context as Flower's simulation builds it."""
    return Context(
        run_id=1,
        node_id=100 + partition_id,
        node_config={"partition-id": partition_id, "num-partitions": num_partitions},
        state=RecordDict(),
        run_config={},
    )


class Nodes(Grid):
    """A Grid that only lists ``num_nodes`` node ids (100, 101, ...): enough for ``configure_train``."""

    def __init__(self, num_nodes: int) -> None:
        self.num_nodes = num_nodes

    def get_node_ids(self) -> Iterable[int]:
        return list(range(100, 100 + self.num_nodes))

    def set_run(self, run: Any) -> None:
        raise NotImplementedError

    @property
    def run(self) -> Any:
        raise NotImplementedError

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        raise NotImplementedError

    def push_messages(self, messages: Any) -> Any:
        raise NotImplementedError

    def pull_messages(self, message_ids: Any) -> Any:
        raise NotImplementedError

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> Any:
        raise NotImplementedError


def reply(to: Message, arrays: list[np.ndarray], num_examples: int, declared: dict[str, Any]) -> Message:
    """The reply of node ``to.dst_node_id`` carrying an upload and what its client declares, laid out as the
    ClientApp lays it out: the ``defense.*`` keys of ``declared`` as its reports, the rest as sent (any value,
    for the server's checks to judge)."""
    to.metadata.__dict__["_message_id"] = to.metadata.message_id or uuid.uuid4().hex
    reports = {k: v for k, v in declared.items() if k.startswith(REPORT_PREFIX)}
    sent = {"loss": 0.5, **{k: v for k, v in declared.items() if k not in reports}}
    sparse = sent.get(ENCODING_KEY) == SPARSE
    names = encoded_names(len(arrays)) if sparse else list(to.content[ARRAYS].keys())
    content = reply_content(array_record(names, arrays), num_examples, 0.5, sent, reports)
    message = Message(content=content, reply_to=to)
    message.metadata.__dict__["_src_node_id"] = to.metadata.dst_node_id
    return message


def train_round(
    strategy: Strategy,
    server_round: int,
    names: list[str],
    arrays: list[np.ndarray],
    uploads: list[tuple[list[np.ndarray], int, dict[str, Any]]],
) -> tuple[ArrayRecord | None, MetricRecord | None, list[Message]]:
    """One round of ``strategy`` on ``len(uploads)`` nodes answering ``uploads`` (node order): the aggregate,
    its metrics and the instructions sent."""
    sent = sorted(
        strategy.configure_train(server_round, array_record(names, arrays), ConfigRecord(), Nodes(len(uploads))),
        key=lambda m: m.metadata.dst_node_id,
    )
    replies = [reply(m, *upload) for m, upload in zip(sent, uploads)]
    aggregated, metrics = strategy.aggregate_train(server_round, replies)
    return aggregated, metrics, sent


def client_fit(
    cfg: Config,
    client: int,
    arrays: list[np.ndarray],
    round_: int,
    state: RecordDict | None = None,
    **instructions: Any,
):
    """(upload, num_examples, declared) of one client's fit."""
    return DefendedClient(cfg, client, state if state is not None else RecordDict()).fit(
        arrays, {ROUND_KEY: round_, **instructions}
    )


class ListSink:
    """Collects the observations it is given."""

    def __init__(self) -> None:
        self.items: list[Observation] = []

    def submit(self, obs: Observation) -> None:
        self.items.append(obs)

    def close(self, timeout: float | None = None) -> None:
        pass


def rewrite_meta(path: Path, **meta_changes: Any) -> None:
    """Change the ``meta`` entry of the trained file ``path`` (an ``.npz``) in place, keeping its arrays."""
    with np.load(path, allow_pickle=False) as archive:
        arrays = {name: archive[name] for name in archive.files}
    meta = {**json.loads(str(arrays.pop("meta"))), **meta_changes}
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)
