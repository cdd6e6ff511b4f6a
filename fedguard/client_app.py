"""The Flower ClientApp: one ``DefendedClient`` per SuperNode and round.

The client's partition comes from the SuperNode's node config
(``partition-id``, ``num-partitions``), as Flower's simulation and
``flower-supernode --node-config`` set it.
"""

from __future__ import annotations

from typing import Callable

from flwr.app import Context
from flwr.client import Client, ClientApp

from clients import DefendedClient
from fedguard.config import Config


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


def make_client_fn(config: Config | None = None) -> Callable[[Context], Client]:
    """A client factory bound to ``config``, or reading Flower's run config when None."""

    def client_fn(context: Context) -> Client:
        cfg = config if config is not None else Config.from_flat(context.run_config)
        return DefendedClient(cfg, partition_of(context, cfg), context.state).to_client()

    return client_fn


def make_client_app(config: Config | None = None) -> ClientApp:
    """A ClientApp bound to ``config``, or reading Flower's run config when None."""
    return ClientApp(client_fn=make_client_fn(config))


app = make_client_app()
