"""``Audit``: fedguard's server side around any Message-API strategy of a Flower app (Flower's ``FedAvg``,
``FedProx``, ``FedAdam``, a subclass of one's own).

``Audit(strategy, context).start(grid, initial_arrays, ...)`` runs the app's federation as ``strategy.start``
would and writes a fedguard run folder: ``config.toml`` (the run config's ``fedguard.*`` keys), every round's
row (the app's own evaluation: ``accuracy`` and ``loss`` of its federated or central evaluation, the defense's
reports, the clients' detector findings), the uploads captured in the targeted rounds (``capture.*``: an
honest-but-curious server, or a malicious one when ``threat.malicious`` schedules a manipulation of the model
sent), every configured attack on them (``attack.name``) scored against the truth the clients' ``truth_mod``
wrote, and ``report.html``. The model must be registered with fedguard (``model.name``, a plugin named by
``server.plugins``) so that the attacks can rebuild it; its entries must be the app's.

Replies of clients that declined a flagged model (``detect.action = 'skip'``) are recorded and kept from the
strategy, which aggregates the others.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from attackers.base import check_attack_files
from attackers.sinks import FanOut
from fedguard.config import Config
from fedguard.flower.mods import is_trainable
from fedguard.flower.settings import PREFIX, audit_config
from fedguard.observation import ModelCard
from fedguard.report.rounds import RoundRecorder
from fedguard.runtime.server_app import (
    build_attack_pool,
    capture_strategy,
    finish_run,
    round_accounting,
    starting_point,
    under_runs_home,
)
from fedguard.runtime.stopping import RunInterrupted, StoppableGrid, StopRequest, stop_on_flower_exit
from fedguard.store.card import initial_model, model_card
from fedguard.store.folder import APP_FILE, write_atomic
from fedguard.store.observation_files import DiskSink
from fedguard.store.run_dir import OBSERVATIONS_DIR, ROUNDS_FILE
from fedguard.tracking import open_trackers
from fedguard.wire.records import CLIENT_KEY, DECLARED, declined, read_findings, read_upload
from strategies.client_failures import ClientFailure
from strategies.wrapper import StrategyWrapper, aggregation_line

log = logging.getLogger(__name__)

CentralEvaluation = Callable[[int, ArrayRecord], MetricRecord | None]


def check_card(card: ModelCard, initial: ArrayRecord) -> None:
    """``ValueError`` unless the app's initial arrays are the registered model's entries, in its order and shapes,
    and the mods' rule for what is trainable (``fedguard.flower.mods.is_trainable``) matches the model's."""
    names = list(initial.keys())
    arrays = initial.to_numpy_ndarrays()
    if tuple(names) != card.names:
        raise ValueError(
            f"{PREFIX}model.name = {card.model!r} has the entries {list(card.names)[:6]}..., the app's initial "
            f"arrays {names[:6]}...: register the app's own model with fedguard and name it there"
        )
    shown = [n for n, a, t in zip(names, arrays, card.trainable) if is_trainable(n, a) != t]
    if shown:
        raise ValueError(f"entries {shown[:4]} are not told apart as parameters and buffers by their names and types")


def recorded_as_run(config: Config, num_rounds: int, nodes: int) -> Config:
    """``config`` with the app's rounds, and its ``nodes`` as the clients (at least one), as the run folder records
    it."""
    clients = max(nodes, 1)
    train = dataclasses.replace(config.train, rounds=num_rounds, clients_per_round=clients)
    partition = dataclasses.replace(config.partition, num_clients=clients)
    return dataclasses.replace(config, train=train, partition=partition)


def declared_client(reply: Message) -> int | str:
    """The client a reply names in its ``declared`` record; for a reply that names none (an error), its node."""
    if not reply.has_error() and isinstance(reply.content.get(DECLARED), ConfigRecord):
        client = reply.content[DECLARED].get(CLIENT_KEY)
        if isinstance(client, int):
            return client
    return f"node {reply.metadata.src_node_id}"


class RoundLog(StrategyWrapper):
    """Writes each round's row once its evaluation is in: the accuracy and loss (the app's metric names
    ``names``: (accuracy, loss)) of the app's central evaluation, else of its federated one (round 0 only with a
    central one); keeps declined replies from ``strategy``."""

    def __init__(self, strategy: Strategy, recorder: RoundRecorder, names: tuple[str, str]) -> None:
        super().__init__(strategy)
        self.recorder = recorder
        self.names = dict(zip(names, ("accuracy", "loss")))
        self.latest: dict[str, Any] = {}
        self.on_replies = round_accounting(self.latest)
        self.pending: dict[int, dict[str, float]] = {}
        self.warned = False
        self.central_evaluation = False

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        kept, uploads, findings = [], [], []
        errors: list[ClientFailure] = []  # an app's node carries no client fedguard assigned
        for reply in replies:
            found = read_findings(reply)
            if found is not None:
                findings.append({"client": declared_client(reply), **found})
            if reply.has_error():
                if found is None:
                    errors.append(ClientFailure.of(None, reply.metadata.src_node_id, reply.error.reason))
                continue
            if declined(reply):
                continue
            kept.append(reply)
            uploads.append(read_upload(reply, arrays=False))
        self.on_replies(server_round, uploads, errors, [], findings, [])  # no rejections, no straggler count
        return self.strategy.aggregate_train(server_round, kept)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        metrics = self.strategy.aggregate_evaluate(server_round, replies)
        self.note(server_round, metrics, central=False)
        if not self.central_evaluation:  # the round's last step
            self.write(server_round)
        return metrics

    def central(self, evaluate_fn: CentralEvaluation | None) -> CentralEvaluation | None:
        """``evaluate_fn`` noting its metrics and writing the round's row (a round's last step); None for None."""
        if evaluate_fn is None:
            return None
        self.central_evaluation = True

        def evaluated(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            metrics = evaluate_fn(server_round, arrays)
            self.note(server_round, metrics, central=True)
            self.write(server_round)
            return metrics

        return evaluated

    def note(self, server_round: int, metrics: MetricRecord | None, central: bool) -> None:
        """Keep the round's ``accuracy`` and ``loss`` (central ones over federated ones)."""
        if metrics is None:
            return
        found = {ours: float(metrics[theirs]) for theirs, ours in self.names.items() if theirs in metrics}  # type: ignore[arg-type]
        row = self.pending.setdefault(server_round, {})
        row.update(found if central else {k: v for k, v in found.items() if k not in row})

    def write(self, server_round: int) -> None:
        """Write the round's row (after its central evaluation, the last step of a round)."""
        row = self.pending.pop(server_round, {})
        if "accuracy" not in row:
            if server_round > 0 and not self.warned:
                accuracy = next(iter(self.names))
                log.warning(
                    "round %d: the app's evaluation reports no %r; its rows are left out", server_round, accuracy
                )
                self.warned = True
            return
        extra = dict(self.latest) if server_round > 0 else {}
        self.recorder.record(server_round, row.get("loss", float("nan")), row["accuracy"], **extra)


class Audit(StrategyWrapper):
    """fedguard's capture, attacks and report around ``strategy`` (module docstring).

    Parameters
    ----------
    strategy : Strategy
        The app's own strategy; it samples, configures and aggregates as it would without fedguard.
    context : Context
        The ServerApp's context: its run config holds the ``fedguard.*`` keys.
    accuracy, loss : str
        The names the app's evaluation (central, else federated) gives the accuracy (a fraction) and the loss.
    """

    def __init__(self, strategy: Strategy, context: Context, accuracy: str = "accuracy", loss: str = "loss") -> None:
        super().__init__(strategy)
        self.metric_names = (accuracy, loss)
        self.config: Config = under_runs_home(audit_config(context), context.run_id)
        self.folder: Path | None = None
        """The run folder, once ``start`` made it."""

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: CentralEvaluation | None = None,
    ) -> Result:
        """Run ``num_rounds`` of the app's federation as ``Strategy.start`` does, with fedguard's capture; the run
        folder is written however it ends."""
        nodes = len(list(grid.get_node_ids()))
        config = recorded_as_run(self.config, num_rounds, nodes)
        check_attack_files(config.attacks)
        folder, _ = starting_point(config)
        write_atomic(folder / APP_FILE, json.dumps({"strategy": repr(self.strategy), "nodes": nodes}) + "\n")
        self.folder = folder
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, out_dir=str(folder)))
        print(f"fedguard: run folder {folder}", flush=True)
        card = model_card(config, initial_model(config))
        check_card(card, initial_arrays)
        stop = StopRequest.from_environment()
        stop_on_flower_exit(stop)
        trackers = open_trackers(config, folder)
        recorder = RoundRecorder(
            folder / ROUNDS_FILE, num_rounds, config.train.clients_per_round, listeners=[trackers.round]
        )
        sinks: list[Any] = [DiskSink(folder / OBSERVATIONS_DIR)]
        pool = build_attack_pool(config, folder, stop, trackers) if config.attacks else None
        if pool is not None:
            sinks.append(pool)
        sink = FanOut(sinks)
        logged = RoundLog(capture_strategy(config, self.strategy, sink, card), recorder, self.metric_names)
        print(f"fedguard: strategy {aggregation_line(logged)}", flush=True)
        outcome = ("failed", "the ServerApp stopped")
        try:
            result = logged.start(
                StoppableGrid(grid, stop),
                initial_arrays,
                num_rounds,
                timeout,
                train_config,
                evaluate_config,
                logged.central(evaluate_fn),
            )
            outcome = ("completed", "")
            return result
        except RunInterrupted as interruption:
            outcome = ("interrupted", str(interruption))
            raise
        except BaseException as error:
            outcome = ("failed", f"{type(error).__name__}: {error}")
            raise
        finally:
            finish_run(folder, config, recorder, outcome, sink, pool, stop, trackers)
