"""The Flower ServerApp, fedguard's composition root: it builds every server component once and runs the
configured strategy on Flower's message API (``Strategy.start``).

Outermost first: ``RoundGuard`` (round instructions, reply accounting) > ``SparseUploads`` (decoding) >
``HonestButCurious`` / ``Malicious`` (capture, when a round and a client are targeted) > ``GradientStep``
(FedSGD through a strategy that aggregates models) > the ``server.strategy``.

``app`` reads its configuration from Flower's run config (``flwr run``);
``make_server_app(config)`` binds a validated ``Config`` (``fedguard run``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy

from attackers.base import AttackOutcome, attack_traits, build_attack, check_attack_files, required_manipulation
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
from fedguard.report.run_status import write_status
from fedguard.report.run_dir import OBSERVATIONS_DIR, ROUNDS_FILE, free_run_dir, prepare_run_dir, resolve_run_dir
from fedguard.records import VAULT_KEY, Upload, array_record
from fedguard.training import evaluate, get_arrays, set_arrays, trainable_mask
from fedguard.vault import VAULT_DIR
from strategies import GradientStep, HonestButCurious, Malicious, RoundGuard, SparseUploads, StrategyContext
from strategies.registry import GRADIENT_NATIVE, build_strategy, resolve

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


def train_config_fn(config: Config, folder: Path) -> Callable[[int], dict[str, Any]]:
    """What each round's train config adds: in targeted rounds, where the ground-truth vault is."""
    rounds = config.capture.round_selection()
    vault = str(folder / VAULT_DIR)

    def train_config(server_round: int) -> dict[str, Any]:
        return {VAULT_KEY: vault} if config.capture.ground_truth and server_round in rounds else {}

    return train_config


def central_evaluation(config: Config, card: ModelCard, recorder: RoundRecorder,
                       latest: dict[str, Any]) -> Callable[[int, ArrayRecord], MetricRecord]:
    """``evaluate_fn`` of ``Strategy.start``: scores the global model on the held-out split after every
    round and writes the round's row (with what ``latest`` holds of its uploads)."""
    x_test, y_test = load_dataset(config.data.name, config.data.source_options()).test.batch()
    evaluator = build_model(config.model.name, card.spec, config.model.params)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        set_arrays(evaluator, arrays.to_numpy_ndarrays())
        loss, accuracy = evaluate(evaluator, x_test, y_test)
        recorder.record(server_round, loss, accuracy, **(latest if server_round > 0 else {}))
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    return evaluate_fn


def build_attack_pool(config: Config, folder: Path) -> AttackPool:
    """The attacker workers running every configured attack, and the evaluator that scores what they return."""
    defense = (config.defense.name, config.defense.params)
    specs = [
        AttackSpec(a.name, functools.partial(build_attack, a.name, a.params, defense),
                   required_manipulation(attack_traits(a.name, a.params)))
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
        seed=config.run.seed,
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


def aggregating_strategy(config: Config, card: ModelCard) -> Strategy:
    """The configured ``server.strategy`` for the run's protocol; a strategy that aggregates models runs
    FedSGD through ``GradientStep``."""
    context = StrategyContext(config.train.clients_per_round, config.partition.num_clients, config.train.lr,
                              card.trainable)
    name, protocol = config.server.strategy, config.train.protocol
    strategy = build_strategy(name, protocol, context, config.strategy.params)
    if protocol == "fedsgd" and resolve(name, protocol) not in GRADIENT_NATIVE:
        strategy = GradientStep(strategy, config.train.lr, card.trainable)
    return strategy


class FederationMismatch(RuntimeError):
    """The federation does not have one SuperNode per configured client."""


def wait_for_nodes(grid: Grid, config: Config, poll: float = 0.5) -> int:
    """Wait up to ``server.connect-timeout`` seconds for one SuperNode per client; returns their number.

    Raises ``FederationMismatch`` saying how to fix it when more are connected, or fewer by then."""
    needed, timeout = config.partition.num_clients, config.server.connect_timeout
    deadline = time.monotonic() + timeout
    while True:
        connected = len(list(grid.get_node_ids()))
        if connected == needed:
            return connected
        if connected > needed or time.monotonic() >= deadline:
            break
        time.sleep(poll)
    cpr = min(config.train.clients_per_round, max(connected, 1))
    raise FederationMismatch(
        f"{connected} SuperNodes are connected{'' if connected > needed else f' after {timeout:.0f} s'}, but "
        f"partition.num-clients = {needed} needs exactly {needed} (one per partition). Give the federation "
        f"{needed}: `flwr run . --federation-config 'num-supernodes={needed}'`; or run {connected or 'N'} "
        f"clients: `--run-config 'partition.num-clients={connected or 'N'} train.clients-per-round={cpr}'`"
    )


def round_accounting(recorder_extra: dict[str, Any]) -> Any:
    """``on_replies`` of ``RoundGuard``: keeps the round's defense reports, sizes and reply counts for the
    row written with its evaluation."""

    def on_replies(server_round: int, uploads: list[Upload], errors: list[str]) -> None:
        recorder_extra.clear()
        reports = aggregate_reports([{**u.reports, **({"client": u.client} if u.client is not None else {})}
                                     for u in uploads])
        if reports.totals:
            recorder_extra["defense"] = reports.totals
        if reports.uploads:
            recorder_extra["uploads"] = reports.uploads
        for key in ("upload-bytes", "dense-bytes"):
            sizes = [float(u.declared[key]) for u in uploads if key in u.declared]
            if sizes:
                recorder_extra[key.replace("-", "_")] = round(sum(sizes) / len(sizes))
        recorder_extra["clients"] = len(uploads)
        if errors:
            recorder_extra["failures"] = len(errors)
            for reason in errors:
                log.warning("round %d: %s", server_round, reason)

    return on_replies


def run_server(grid: Grid, config: Config) -> Path:
    """Run every round on ``grid``; returns the run folder. Outputs are flushed even on failure."""
    check_attack_files(config.attacks)
    folder = resolve_run_dir(config)
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, out_dir=str(folder)))
    prepare_run_dir(config)
    print(f"fedguard: run folder {folder}", flush=True)

    model = initial_model(config)
    card = model_card(config, model)
    strategy = aggregating_strategy(config, card)
    recorder = RoundRecorder(folder / ROUNDS_FILE, config.train.rounds, config.train.clients_per_round)
    latest: dict[str, Any] = {}
    rounds, clients = config.capture.round_selection(), config.capture.client_selection()
    sink: FanOut | None = None
    pool: AttackPool | None = None
    outcome = ("failed", "the ServerApp stopped")
    try:
        wait_for_nodes(grid, config)
        if not (rounds.is_empty() or clients.is_empty()):
            sinks: list[Any] = [DiskSink(folder / OBSERVATIONS_DIR)]
            if config.attacks:
                pool = build_attack_pool(config, folder)
                sinks.append(pool)
            sink = FanOut(sinks)
            strategy = capture_strategy(config, strategy, sink, card)
        strategy = RoundGuard(SparseUploads(strategy), train_config_fn(config, folder), round_accounting(latest))
        strategy.start(
            grid,
            initial_arrays=array_record(card.names, get_arrays(model)),
            num_rounds=config.train.rounds,
            evaluate_fn=central_evaluation(config, card, recorder, latest),
        )
        outcome = ("completed", "")
    except BaseException as error:
        outcome = ("failed", f"{type(error).__name__}: {error}")
        print(f"fedguard: the run failed: {outcome[1]}", flush=True)
        raise
    finally:
        write_status(folder, outcome[0], max((r["round"] for r in recorder.rows), default=0), outcome[1])
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


RUNS_ENV = "FEDGUARD_RUNS"


def runs_home() -> Path:
    """Where runs started by ``flwr run`` go when ``out-dir`` is empty or relative: ``$FEDGUARD_RUNS``, else
    ``~/fedguard-runs`` (the ServerApp's working directory is wherever Flower's SuperLink was started)."""
    return Path(os.environ.get(RUNS_ENV) or Path.home() / "fedguard-runs")


def under_runs_home(config: Config) -> Config:
    """``config`` with its run folder absolute: a relative ``out-dir`` under ``runs_home()``; none,
    ``runs_home()/<name>`` (or ``<name>-2``, ... when that holds a run)."""
    if config.run.out_dir:
        out = Path(config.run.out_dir)
        out = out if out.is_absolute() else runs_home() / out
    else:
        out = free_run_dir(runs_home() / config.run.name)
    return dataclasses.replace(config, run=dataclasses.replace(config.run, out_dir=str(out)))


def make_server_app(config: Config | None = None) -> ServerApp:
    """A ServerApp bound to ``config``, or reading Flower's run config when None (``flwr run``)."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        run_server(grid, config if config is not None else under_runs_home(Config.from_flat(context.run_config)))

    return server_app


app = make_server_app()
