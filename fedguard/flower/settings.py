"""What the mods and the audit wrapper of a Flower app read from its run config: fedguard's keys under the
prefix ``fedguard.`` (``fedguard.defense.name = "dgp"``), beside the app's own keys, so that the ServerApp and
every ClientApp read one configuration and ``flwr run --run-config`` changes it for both."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.app import Context

from fedguard.config import Config, ConfigError
from fedguard.protocols import protocol as run_protocol

PREFIX = "fedguard."
PARTITION_ID = "partition-id"  # node config: the client's id, as Flower's simulation sets it


def fedguard_keys(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The run config's ``fedguard.*`` keys without their prefix."""
    return {key[len(PREFIX) :]: value for key, value in run_config.items() if key.startswith(PREFIX)}


def audit_config(context: Context) -> Config:
    """The fedguard configuration of the app's run config (``fedguard.*`` keys; defaults for the rest); raises
    ``ConfigError`` naming every bad key as ``fedguard.<key>``, and for a protocol whose uploads are not models:
    a Flower app's clients upload what their own training left (FedAvg's kind)."""
    try:
        config = Config.from_flat(fedguard_keys(context.run_config))
    except ConfigError as error:
        raise ConfigError([f"run config {PREFIX}*: {problem}" for problem in error.problems]) from None
    kind = run_protocol(config.train.protocol).upload_kind
    if kind != "weights":
        raise ConfigError(
            [
                f"{PREFIX}train.protocol = {config.train.protocol!r} uploads a {kind}; a Flower app's clients upload "
                "their trained model: set fedguard.train.protocol = 'fedavg'"
            ]
        )
    return config


def client_id(context: Context) -> int:
    """This node's client id: its node config's ``partition-id`` (Flower's simulation sets it; a SuperNode gets
    it from ``--node-config``); ``ValueError`` saying how to set it when absent or not a whole number."""
    value = context.node_config.get(PARTITION_ID)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"node config {PARTITION_ID} = {value!r}: fedguard's mods need the client's id, a whole number >= 0; "
            f"start the SuperNode with --node-config '{PARTITION_ID}=<i> num-partitions=<n>'"
        )
    return value
