"""The Flower ClientApp: a Message-API app whose handlers hand each instruction to a ``DefendedClient``.

A node trains on the partition the server assigned it (``partition-id`` of the train instruction: the
server knows its clients by node id, ``strategies.RoundGuard``); without one, on the partition of the
SuperNode's node config (``partition-id``), as Flower's simulation and ``flower-supernode --node-config``
set it. The node config's ``num-partitions`` must equal ``partition.num-clients``. The reply's layout is in
``fedguard.wire.records``.

Ground truth (the true batch of a targeted upload, kept for scoring) goes only where the client's own
configuration says, never where a message from the server says (``truth_vault``): on Flower's simulation
engine, which runs the server and every client for one party, into the vault of the run's folder
(``fedguard.store.folder.flwr_run_dir``: ``out-dir``, or one named after the Flower run id); on a SuperNode,
only when its operator opts in with the node config's ``vault-dir``.

A client whose detectors flag the model it received declines the round as ``detect.action`` says
(``clients.defended_client.ModelDeclined``): ``skip`` replies with its findings and no upload, ``refuse`` with an
error whose reason holds them (``fedguard.wire.records``).

A client's defense state (``clients.state``) lives in files under the simulated run's folder, on a SuperNode in
its ``Context.state``; a simulated client whose process dies is started again with it
(``fedguard.runtime.actor_restarts``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from clients import DefendedClient
from clients.defended_client import ModelDeclined
from clients.state import ClientState, RecordState
from fedguard.app_code import AppCode
from fedguard.config import Config, ConfigError
from fedguard.data import DatasetNotFoundError
from fedguard.registry import TrainedFileError
from fedguard.runtime.actor_restarts import restart_dead_clients
from fedguard.store.client_state import FileState
from fedguard.store.folder import CLIENT_STATE_DIR, VAULT_DIR, flwr_run_dir
from fedguard.wire.records import (
    ARRAYS,
    CONFIG,
    PARTITION_KEY,
    ClientReply,
    cannot_train_reason,
    declined_content,
    refusal_reason,
)

VAULT_DIR_KEY = "vault-dir"  # node config: the folder under which a SuperNode keeps its ground truth
PERMANENT_ERRORS = (TrainedFileError, ConfigError, DatasetNotFoundError)
"""What fails a client in every round: a trained file it loads, its configuration, its data set."""


def partition_of(context: Context, config: Config, assigned: Any = None) -> int:
    """This node's partition: ``assigned`` (by the server), else the node config's ``partition-id``; checked
    against the configured number of clients."""
    try:
        partition_id = int(context.node_config["partition-id"] if assigned is None else assigned)
        num_partitions = int(context.node_config["num-partitions"])
    except KeyError as missing:
        raise ValueError(
            f"node config lacks {missing}; start the SuperNode with --node-config 'partition-id=<i> num-partitions=<n>'"
        ) from None
    if num_partitions != config.partition.num_clients:
        raise ValueError(
            f"node config says num-partitions={num_partitions} but partition.num-clients="
            f"{config.partition.num_clients}; make them equal"
        )
    return partition_id


def in_simulation() -> bool:
    """Whether this ClientApp runs on Flower's simulation engine: inside one of its Ray actors. A SuperNode
    never runs its ClientApp in Ray, and nothing a server sends can make it."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def simulated_vault(config: Config, run_id: int) -> Path:
    """The vault of Flower run ``run_id``'s folder, resolved as the ServerApp resolves it."""
    return flwr_run_dir(config.run.out_dir, config.run.name, run_id) / VAULT_DIR


def node_vault(context: Context) -> Path | None:
    """``run-<run id>`` under the node config's ``vault-dir`` (an absolute path), or None when the SuperNode's
    operator did not opt in."""
    root = context.node_config.get(VAULT_DIR_KEY)
    if root is None:
        return None
    if not isinstance(root, str) or not Path(root).is_absolute():
        raise ValueError(
            f"node config {VAULT_DIR_KEY}={root!r}: give an absolute folder, e.g. "
            f"--node-config '... {VAULT_DIR_KEY}=\"/vault\"'"
        )
    return Path(root) / f"run-{context.run_id}"


def truth_vault(context: Context, config: Config) -> Path | None:
    """Where this client writes the true batches of targeted uploads, or None for nowhere: the simulated run's
    vault, or the SuperNode's own (``node_vault``); nowhere when ``capture.ground-truth`` is off."""
    if not config.capture.ground_truth:
        return None
    return simulated_vault(config, context.run_id) if in_simulation() else node_vault(context)


def client_state(context: Context, config: Config, client: int) -> ClientState:
    """Where ``client`` keeps its defense state: in simulation, files under the run folder (memory does not grow
    with the number of clients, and ``fedguard run --resume`` finds them); on a SuperNode, its ``Context.state``."""
    if in_simulation():
        run_dir = flwr_run_dir(config.run.out_dir, config.run.name, context.run_id)
        return FileState(run_dir / CLIENT_STATE_DIR, client)
    return RecordState(context.state)


def upload_reply(msg: Message, reply: ClientReply) -> Message:
    """The message carrying a ``DefendedClient.round_reply`` answer to ``msg`` (the records of
    ``fedguard.wire.records``)."""
    return Message(content=reply.content(list(cast(ArrayRecord, msg.content[ARRAYS]).keys())), reply_to=msg)


def declined_reply(msg: Message, declined: ModelDeclined) -> Message:
    """The reply of a client that declines the round: its findings and no upload (``skip``), or an error whose
    reason holds them (``refuse``)."""
    findings = declined.verdict.row()
    if declined.verdict.action == "refuse":
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, refusal_reason(findings)), reply_to=msg)
    return Message(content=declined_content(declined.client, findings), reply_to=msg)


class ShippedClientApp(AppCode, ClientApp):
    """Flower's ClientApp, rebuilt from this app's code in the Ray actors Flower's simulation ships it to
    (``fedguard.app_code``)."""


def make_client_app(config: Config | None = None) -> ClientApp:
    """A ClientApp bound to ``config``, or reading Flower's run config when None. In a process that runs Flower's
    simulation engine, its client actors are from then on restarted when they die (``restart_dead_clients``)."""
    restart_dead_clients()
    client_app = ShippedClientApp()

    def client(context: Context, instruction: ConfigRecord) -> DefendedClient:
        cfg = config if config is not None else Config.from_run_config(context.run_config, attack_side=False)
        partition = partition_of(context, cfg, instruction.get(PARTITION_KEY))
        return DefendedClient(cfg, partition, client_state(context, cfg, partition), truth_vault(context, cfg))

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = cast(ArrayRecord, msg.content[ARRAYS]).to_numpy_ndarrays()
        try:
            instruction = cast(ConfigRecord, msg.content[CONFIG])
            answer = client(context, instruction).round_reply(arrays, dict(instruction))
        except PERMANENT_ERRORS as error:
            return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, cannot_train_reason(error)), reply_to=msg)
        except ModelDeclined as declined:
            return declined_reply(msg, declined)
        return upload_reply(msg, answer)

    return client_app


app = make_client_app()
