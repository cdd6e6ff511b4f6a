"""The Flower ServerApp: global model, FedSGD/FedAvg, capture of targeted uploads, round log.

``app`` reads its configuration from Flower's run config (``flwr run``);
``make_server_app(config)`` binds a validated ``Config`` (``fedguard run``).
"""

from __future__ import annotations

import dataclasses
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

from attackers.sinks import DiskSink
from fedguard.config import Config
from fedguard.data import load_dataset
from fedguard.models import build_model
from fedguard.observation import ModelCard
from fedguard.report.rounds import RoundRecorder
from fedguard.report.run_dir import OBSERVATIONS_DIR, ROUNDS_FILE, prepare_run_dir, resolve_run_dir
from fedguard.training import evaluate, get_arrays, set_arrays, trainable_mask
from strategies import FedSGD, HonestButCurious

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


def build_strategy(config: Config, model: torch.nn.Module, recorder: RoundRecorder) -> Strategy:
    """FedSGD or FedAvg with centralized evaluation on the held-out split after every round."""
    test = load_dataset(config.data.name, config.data.source_options()).test
    x_test, y_test = test.batch()
    evaluator = build_model(config.model.name, model_card(config, model).spec, config.model.params)

    def evaluate_fn(server_round: int, arrays: list[np.ndarray], _: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        set_arrays(evaluator, arrays)
        loss, accuracy = evaluate(evaluator, x_test, y_test)
        recorder.record(server_round, loss, accuracy)
        return loss, {"accuracy": accuracy}

    train, clients = config.train, config.partition.num_clients
    common: dict[str, Any] = dict(
        fraction_fit=train.clients_per_round / clients,
        min_fit_clients=train.clients_per_round,
        min_available_clients=train.clients_per_round,
        fraction_evaluate=0.0,
        min_evaluate_clients=0,
        evaluate_fn=evaluate_fn,
        on_fit_config_fn=lambda server_round: {"round": server_round},
        initial_parameters=ndarrays_to_parameters(get_arrays(model)),
        fit_metrics_aggregation_fn=lambda metrics: {},
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
    strategy = build_strategy(config, model, recorder)
    rounds, clients = config.capture.round_selection(), config.capture.client_selection()
    sink = None
    if not (rounds.is_empty() or clients.is_empty()):
        sink = DiskSink(folder / OBSERVATIONS_DIR)
        kind = "gradient" if config.train.protocol == "fedsgd" else "weights"
        strategy = HonestButCurious(strategy, sink, model_card(config, model), kind, rounds, clients)
    try:
        start_grid(grid=grid, strategy=strategy, config=ServerConfig(num_rounds=config.train.rounds))
    finally:
        recorder.close()
        if sink is not None:
            sink.close(timeout=60.0)
        print(f"fedguard: {recorder.summary()}", flush=True)
        if sink is not None:
            print(f"fedguard: {len(sink.saved)} uploads captured in {folder / OBSERVATIONS_DIR}", flush=True)
    return folder


def make_server_app(config: Config | None = None) -> ServerApp:
    """A ServerApp bound to ``config``, or reading Flower's run config when None."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        run_server(grid, config if config is not None else Config.from_flat(context.run_config))

    return server_app


app = make_server_app()
