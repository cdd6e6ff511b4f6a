"""The Flower ClientApp: a Message-API app whose handlers hand each instruction to a ``DefendedClient``.

The client's partition comes from the SuperNode's node config (``partition-id``, ``num-partitions``), as
Flower's simulation and ``flower-supernode --node-config`` set it. The reply's layout is in
``fedguard.records``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients import DefendedClient
from fedguard.config import Config
from fedguard.defenses.base import REPORT_PREFIX
from fedguard.records import ARRAYS, CONFIG, NUM_EXAMPLES, array_record, reply_content
from fedguard.sparse import ENCODING_KEY, SPARSE


def partition_of(context: Context, config: Config) -> int:
    """This node's partition id, checked against the configured number of clients."""
    try:
        partition_id = int(context.node_config["partition-id"])
        num_partitions = int(context.node_config["num-partitions"])
    except KeyError as missing:
        raise ValueError(
            f"node config lacks {missing}; start the SuperNode with "
            "--node-config 'partition-id=<i> num-partitions=<n>'"
        ) from None
    if num_partitions != config.partition.num_clients:
        raise ValueError(
            f"node config says num-partitions={num_partitions} but partition.num-clients="
            f"{config.partition.num_clients}; make them equal"
        )
    return partition_id


def upload_reply(msg: Message, upload: list[np.ndarray], num_examples: int, metrics: dict[str, Any]) -> Message:
    """The reply carrying a ``DefendedClient.fit`` result as typed records."""
    reports = {k: v for k, v in metrics.items() if k.startswith(REPORT_PREFIX)}
    declared = {k: v for k, v in metrics.items() if not k.startswith(REPORT_PREFIX)}
    if declared.get(ENCODING_KEY) == SPARSE:
        names = [f"encoded-{i}" for i in range(len(upload))]
    else:
        names = list(msg.content[ARRAYS].keys())
    content = reply_content(array_record(names, upload), num_examples, float(declared.get("loss", 0.0)),
                            declared, reports)
    return Message(content=content, reply_to=msg)


def make_client_app(config: Config | None = None) -> ClientApp:
    """A ClientApp bound to ``config``, or reading Flower's run config when None."""
    client_app = ClientApp()

    def client(context: Context) -> DefendedClient:
        cfg = config if config is not None else Config.from_flat(context.run_config)
        return DefendedClient(cfg, partition_of(context, cfg), context.state)

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = msg.content[ARRAYS].to_numpy_ndarrays()
        upload, num_examples, metrics = client(context).fit(arrays, dict(msg.content[CONFIG]))
        return upload_reply(msg, upload, num_examples, metrics)

    @client_app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        arrays = msg.content[ARRAYS].to_numpy_ndarrays()
        loss, num_examples, metrics = client(context).evaluate(arrays, dict(msg.content[CONFIG]))
        record = MetricRecord({NUM_EXAMPLES: num_examples, "loss": loss, "accuracy": float(metrics["accuracy"])})
        return Message(content=RecordDict({"metrics": record, "declared": ConfigRecord({"client": metrics["client"]})}),
                       reply_to=msg)

    return client_app


app = make_client_app()
