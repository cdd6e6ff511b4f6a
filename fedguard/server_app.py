"""The Flower ServerApp: global model, FedSGD/FedAvg, capture of targeted uploads, round log.

``app`` reads its configuration from Flower's run config (``flwr run``);
``make_server_app(config)`` binds a validated ``Config`` (``fedguard run``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Context
from flwr.common import ndarrays_to_parameters
from flwr.server import Grid, ServerApp, ServerConfig
from flwr.server.compat import start_grid
from flwr.server.strategy import FedAvg, Strategy

from attackers.base import AttackOutcome, build_attack, required_manipulation
from attackers.manipulation import build_manipulation
from attackers.pool import AttackPool, AttackSpec
from attackers.sinks import DiskSink, FanOut
from fedguard.config import Config
from fedguard.data import load_dataset
from fedguard.defenses import aggregate_reports
from fedguard.models import build_model
from fedguard.evaluation import ATTACKS_FILE, Evaluator, attack_contexts, describe_row
from fedguard.observation import ModelCard
from fedguard.report.html import build_report
from fedguard.report.rounds import RoundRecorder
from fedguard.report.run_dir import OBSERVATIONS_DIR, ROUNDS_FILE, prepare_run_dir, resolve_run_dir
from fedguard.training import evaluate, get_arrays, set_arrays, trainable_mask
from fedguard.vault import VAULT_DIR
from strategies import FedSGD, HonestButCurious, Malicious, SparseUploads

log = logging.getLogger(__name__)


def initial_model(config: Config) -> torch.nn.Module:
    """The global model at round 0, initialized from the run seed."""
    spec = load_dataset(config.data.name, config.data.source_options()).spec
    torch.manual_seed(config.run.seed)
    return build_model(config.model.name, spec, config.model.params)


def model_card(config: Config, model: torch.nn.Module) -> ModelCard:
    """What the server knows of ``model``."""
    return ModelCard(
        model=config.model.name,
        model_params=dataclasses.asdict(config.model.params),
        spec=load_dataset(config.data.name, config.data.source_options()).spec,
        names=tuple(model.state_dict()),
        trainable=tuple(trainable_mask(model)),
    )


def fit_config_fn(config: Config, folder: Path) -> Any:
    """Per-round client instructions: the round number and, in targeted rounds, where the vault is."""
    rounds = config.capture.round_selection()
    vault = str(folder / VAULT_DIR)

    def fit_config(server_round: int) -> dict[str, Any]:
        if config.capture.ground_truth and server_round in rounds:
            return {"round": server_round, "vault": vault}
        return {"round": server_round}

    return fit_config


def build_attack_pool(config: Config, folder: Path) -> AttackPool:
    """The attacker workers running every configured attack, and the evaluator that scores what they return."""
    defense = (config.defense.name, config.defense.params)
    specs = [
        AttackSpec(a.name, functools.partial(build_attack, a.name, a.params, defense),
                   required_manipulation(build_attack(a.name, a.params, defense)))
        for a in config.attacks
    ]
    evaluator = Evaluator(folder, attack_contexts(config))

    def score_and_announce(outcome: AttackOutcome) -> None:
        print(f"fedguard: attack {describe_row(evaluator(outcome))}", flush=True)

    return AttackPool(
        specs,
        score_and_announce,
        workers=config.pool.workers,
        time_limit=config.pool.time_limit,
        group=config.pool.group,
        threads=config.pool.threads,
        use_gpu=any(getattr(a.params, "device", "cpu") != "cpu" for a in config.attacks),
        address=config.pool.address or None,
    )


def capture_strategy(config: Config, inner: Strategy, sink: Any, card: ModelCard) -> Strategy:
    """``inner`` wrapped to capture targeted uploads: honest-but-curious, or malicious when
    ``threat.malicious`` schedules manipulations."""
    kind = "gradient" if config.train.protocol == "fedsgd" else "weights"
    rounds, clients = config.capture.round_selection(), config.capture.client_selection()
    schedule = {
        round_: (name, build_manipulation(name, config.manipulation(name).params))
        for round_, name in config.threat.schedule().items()
    }
    if schedule:
        return Malicious(inner, sink, card, kind, rounds, clients, schedule, seed=config.run.seed)
    return HonestButCurious(inner, sink, card, kind, rounds, clients)


def build_strategy(config: Config, model: torch.nn.Module, recorder: RoundRecorder, folder: Path) -> Strategy:
    """FedSGD or FedAvg with centralized evaluation on the held-out split after every round."""
    test = load_dataset(config.data.name, config.data.source_options()).test
    x_test, y_test = test.batch()
    evaluator = build_model(config.model.name, model_card(config, model).spec, config.model.params)

    latest: dict[str, Any] = {}  # the latest round's defense reports and upload sizes, written with its evaluation

    def aggregate_fit_metrics(metrics: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
        latest.clear()
        reports = aggregate_reports([m for _, m in metrics])
        if reports.totals:
            latest["defense"] = reports.totals
        if reports.uploads:
            latest["uploads"] = reports.uploads
        for key in ("upload-bytes", "dense-bytes"):
            sizes = [float(m[key]) for _, m in metrics if key in m]
            if sizes:
                latest[key.replace("-", "_")] = round(sum(sizes) / len(sizes))
        return {}

    def evaluate_fn(server_round: int, arrays: list[np.ndarray], _: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        set_arrays(evaluator, arrays)
        loss, accuracy = evaluate(evaluator, x_test, y_test)
        recorder.record(server_round, loss, accuracy, **(latest if server_round > 0 else {}))
        return loss, {"accuracy": accuracy}

    train, clients = config.train, config.partition.num_clients
    common: dict[str, Any] = dict(
        fraction_fit=train.clients_per_round / clients,
        min_fit_clients=train.clients_per_round,
        min_available_clients=train.clients_per_round,
        fraction_evaluate=0.0,
        min_evaluate_clients=0,
        evaluate_fn=evaluate_fn,
        on_fit_config_fn=fit_config_fn(config, folder),
        initial_parameters=ndarrays_to_parameters(get_arrays(model)),
        fit_metrics_aggregation_fn=aggregate_fit_metrics,
    )
    if train.protocol == "fedsgd":
        return FedSGD(lr=train.lr, trainable=trainable_mask(model), **common)
    return FedAvg(**common)


def run_server(grid: Grid, config: Config) -> Path:
    """Run every round on ``grid``; returns the run folder. Outputs are flushed even on failure."""
    folder = resolve_run_dir(config)
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, out_dir=str(folder)))
    prepare_run_dir(config)
    print(f"fedguard: run folder {folder}", flush=True)

    model = initial_model(config)
    recorder = RoundRecorder(folder / ROUNDS_FILE, config.train.rounds, config.train.clients_per_round)
    strategy = build_strategy(config, model, recorder, folder)
    rounds, clients = config.capture.round_selection(), config.capture.client_selection()
    sink: FanOut | None = None
    pool: AttackPool | None = None
    if not (rounds.is_empty() or clients.is_empty()):
        sinks: list[Any] = [DiskSink(folder / OBSERVATIONS_DIR)]
        if config.attacks:
            pool = build_attack_pool(config, folder)
            sinks.append(pool)
        sink = FanOut(sinks)
        strategy = capture_strategy(config, strategy, sink, model_card(config, model))
    strategy = SparseUploads(strategy)
    try:
        start_grid(grid=grid, strategy=strategy, config=ServerConfig(num_rounds=config.train.rounds))
    finally:
        recorder.close()
        print(f"fedguard: {recorder.summary()}", flush=True)
        if sink is not None:
            if pool is not None and pool.pending():
                print(f"fedguard: waiting up to {config.pool.wait:.0f} s for {pool.pending()} attacks", flush=True)
            sink.close(timeout=config.pool.wait)
            captured = len(list((folder / OBSERVATIONS_DIR).glob("*.npz")))
            print(f"fedguard: {captured} uploads captured in {folder / OBSERVATIONS_DIR}", flush=True)
        if pool is not None:
            stats = pool.stats
            print(f"fedguard: attacks: {stats.ok} ok, {stats.error} failed, {stats.timeout} timed out; "
                  f"results in {folder / ATTACKS_FILE}", flush=True)
        print(f"fedguard: report {build_report(folder)}", flush=True)
    return folder


def make_server_app(config: Config | None = None) -> ServerApp:
    """A ServerApp bound to ``config``, or reading Flower's run config when None."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        run_server(grid, config if config is not None else Config.from_flat(context.run_config))

    return server_app


app = make_server_app()
