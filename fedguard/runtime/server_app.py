"""The Flower ServerApp, fedguard's composition root: it builds every server component once and runs the
configured strategy on Flower's message API (``Strategy.start``).

Outermost first: ``RoundGuard`` (round instructions, checks, reply accounting) > ``HonestButCurious`` /
``Malicious`` (capture, when a round and a client are targeted) > ``SparseUploads`` (decoding, for a strategy
that reads the records itself; FedSGD decodes one upload at a time as it adds them) > ``GradientStep`` (FedSGD
through a strategy that aggregates models) > the ``server.strategy``.

After every round the global model and the strategy's state are checkpointed in the run folder
(``fedguard.store.checkpoint``); with ``resume`` (``fedguard run --resume``) a run goes on from its last checkpoint.

``app`` reads its configuration from Flower's run config (``flwr run``);
``make_server_app(config)`` binds a validated ``Config`` (``fedguard run``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy

from attackers.base import AttackOutcome, check_attack_files
from attackers.manipulation import build_manipulation
from attackers.pool import AttackPool
from attackers.runner import attack_specs
from attackers.sinks import FanOut
from fedguard.config import Config, ConfigError, relative_path_problems, split_names
from fedguard.data import load_dataset
from fedguard.defenses import aggregate_reports
from fedguard.defenses.base import check_defense_files
from fedguard.evaluation import Evaluator, attack_contexts, describe_row, status_counts
from fedguard.models import build_model
from fedguard.observation import ModelCard
from fedguard.plugin_faults import PluginFailure, raising_plugin
from fedguard.protocols import protocol as run_protocol
from fedguard.report.html import build_report
from fedguard.report.rounds import RoundRecorder
from fedguard.report.run_status import write_status
from fedguard.runtime.message_index import index_message_delivery, remove_message_index
from fedguard.runtime.stopping import RunInterrupted, StoppableGrid, StopRequest, stop_on_flower_exit
from fedguard.runtime.stuck_plugin import watch_for_stuck_plugin
from fedguard.store.card import initial_model, model_card, upload_rules
from fedguard.store.checkpoint import RoundCheckpoint, write_checkpoint
from fedguard.store.folder import ATTACKS_FILE, RunFileUnwritable, flwr_run_dir
from fedguard.store.invocations import RUN_INVOCATION
from fedguard.store.observation_files import DiskSink
from fedguard.store.resume import resume_point, rewind
from fedguard.store.rows import read_attacks, read_rounds
from fedguard.store.run_dir import OBSERVATIONS_DIR, ROUNDS_FILE, prepare_run_dir, resolve_run_dir
from fedguard.tracking import Trackers, open_trackers
from fedguard.training import evaluate, get_arrays, set_arrays
from fedguard.wire.records import Upload, array_record
from strategies import (
    AllClientsFailed,
    FedSGD,
    GradientStep,
    HonestButCurious,
    Malicious,
    RoundGuard,
    SparseUploads,
    StrategyContext,
)
from strategies.client_failures import ClientFailure
from strategies.registry import aggregates_gradients, build_strategy, resolve
from strategies.round_guard import OnReplies
from strategies.state import restore_strategy_state, strategy_state
from strategies.upload_checks import NonFiniteModel, Rejection, nonfinite_problem
from strategies.wrapper import aggregation_line

log = logging.getLogger(__name__)


def central_evaluation(
    config: Config,
    card: ModelCard,
    recorder: RoundRecorder,
    latest: dict[str, Any],
    checkpoint: Callable[[int, list[str], list[Any]], None],
    rounds_done: int = 0,
) -> Callable[[int, ArrayRecord], MetricRecord | None]:
    """``evaluate_fn`` of ``Strategy.start``: scores the global model on the held-out split after every
    round, writes the round's row (with what ``latest`` holds of its uploads), then ``checkpoint``s the round.
    A global model holding a NaN or an infinity stops the run with ``NonFiniteModel``, its row saying why
    (``stopped``). Flower's round r is round ``rounds_done`` + r; a resumed run's round 0 (the checkpoint
    it starts from, already recorded) is skipped."""
    x_test, y_test = load_dataset(config.data.name, config.data.source_options()).test.batch()
    evaluator = build_model(config.model.name, card.spec, config.model.params)

    def evaluate_fn(flower_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if rounds_done and flower_round == 0:
            return None
        server_round = flower_round + rounds_done
        values = arrays.to_numpy_ndarrays()
        set_arrays(evaluator, values)
        loss, accuracy = evaluate(evaluator, x_test, y_test)
        problem = nonfinite_problem(list(arrays.keys()), values)
        stopped = {} if problem is None else {"stopped": f"the global model's {problem}"}
        recorder.record(server_round, loss, accuracy, **(latest if server_round > 0 else {}), **stopped)
        if problem is not None:
            raise NonFiniteModel(f"round {server_round}: after aggregation the global model's {problem}; the run stops")
        checkpoint(server_round, list(arrays.keys()), values)
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    return evaluate_fn


def round_checkpoints(folder: Path, strategy: Strategy) -> Callable[[int, list[str], list[Any]], None]:
    """Writes ``checkpoint.npz`` of ``folder``: the round, the global model (names, arrays) and the state of
    ``strategy``."""

    def checkpoint(server_round: int, names: list[str], values: list[Any]) -> None:
        write_checkpoint(folder, RoundCheckpoint(server_round, tuple(names), values, strategy_state(strategy)))

    return checkpoint


def starting_point(config: Config) -> tuple[Path, RoundCheckpoint | None]:
    """The run folder and, when the run resumes, the checkpoint it goes on from (the folder rewound to it);
    a new run gets a folder of its own and its ``config.toml``."""
    point = None
    if config.run.resume:
        folder = Path(config.run.out_dir).resolve()
        point = resume_point(folder, config.train.rounds)
        removed = {k: v for k, v in rewind(folder, point.round).items() if v}
        gone = f"; removed what the unfinished round left: {removed}" if removed else ""
        print(f"fedguard: resuming after round {point.round} of {config.train.rounds}{gone}", flush=True)
    else:
        folder = resolve_run_dir(config)
    prepare_run_dir(dataclasses.replace(config, run=dataclasses.replace(config.run, out_dir=str(folder), resume=False)))
    return folder, point


def resumed_arrays(card: ModelCard, point: RoundCheckpoint, model: torch.nn.Module) -> list[Any]:
    """The checkpoint's global model, checked against the run's model."""
    expected = get_arrays(model)
    if point.names != card.names or any(a.shape != e.shape for a, e in zip(point.arrays, expected)):
        raise ValueError(
            f"the checkpoint of round {point.round} holds another model than {card.model} "
            f"({len(point.names)} arrays, the run's has {len(card.names)}); resume with the run's "
            "own config.toml"
        )
    return point.arrays


def build_attack_pool(config: Config, folder: Path, stop: StopRequest, trackers: Trackers) -> AttackPool:
    """The attacker workers running every configured attack, and the evaluator that scores what they return
    (each row also to ``trackers``); they stop taking work once ``stop`` is requested."""
    specs = attack_specs(config.attacks, (config.defense.name, config.defense.params))
    evaluator = Evaluator(folder, attack_contexts(config, invocation=RUN_INVOCATION), listeners=[trackers.attack])

    def score_and_announce(outcome: AttackOutcome) -> None:
        print(f"fedguard: attack {describe_row(evaluator(outcome))}", flush=True)

    return AttackPool(
        specs,
        score_and_announce,
        workers=config.pool.workers,
        time_limit=config.pool.time_limit,
        group=config.pool.group,
        threads=config.pool.threads,
        use_gpu=any(device != "cpu" for device in config.attack_devices().values()),
        address=config.pool.address or None,
        seed=config.run.seed,
        stop=stop.reason,
    )


def capture_strategy(config: Config, inner: Strategy, sink: Any, card: ModelCard) -> Strategy:
    """``inner`` wrapped to capture targeted uploads: honest-but-curious, or malicious when
    ``threat.malicious`` schedules manipulations; each round's aggregate only under ``threat.aggregation =
    'secure'``."""
    kind = run_protocol(config.train.protocol).upload_kind
    rounds, clients = config.capture.round_selection(), config.capture.client_selection()
    names = config.threat.schedule()
    built = {name: build_manipulation(name, config.manipulation(name).params) for name in set(names.values())}
    schedule = {round_: (name, built[name]) for round_, name in names.items()}  # one instance across its rounds
    secure = config.threat.aggregation == "secure"
    per_round = config.capture.per_round
    if schedule:
        return Malicious(
            inner, sink, card, kind, rounds, clients, schedule, seed=config.run.seed, per_round=per_round, secure=secure
        )
    return HonestButCurious(inner, sink, card, kind, rounds, clients, per_round, secure)


def aggregating_strategy(config: Config, card: ModelCard) -> Strategy:
    """The configured ``server.strategy`` for the run's protocol; a strategy that aggregates models runs
    FedSGD through ``GradientStep``; any but FedSGD behind ``SparseUploads``."""
    context = StrategyContext(
        config.train.clients_per_round, config.partition.num_clients, config.train.lr, card.trainable
    )
    name, protocol = config.server.strategy, config.train.protocol
    strategy = build_strategy(name, protocol, context, config.strategy.params)
    if run_protocol(protocol).upload_kind == "gradient" and not aggregates_gradients(resolve(name, protocol)):
        strategy = GradientStep(strategy, config.train.lr, card.trainable)
    return strategy if isinstance(strategy, FedSGD) else SparseUploads(strategy)


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


def round_accounting(recorder_extra: dict[str, Any]) -> OnReplies:
    """``on_replies`` of ``RoundGuard``: keeps the round's defense reports, sizes, reply counts, the clients that
    failed (``failures``, their number; ``failed``: ``{"client", "node", "reason"}`` each), rejected uploads
    (``rejected``: ``{"client", "reason"}`` each), the clients that did not reply within ``server.round-timeout``
    (``stragglers``), the clients' detector findings (``detect``:
    ``{"client", <finding>: value, ..., "action"}`` each; ``declined``: how many skipped or refused the round)
    and ``skipped`` when no upload was left, for the row written with its evaluation."""

    def on_replies(
        server_round: int,
        uploads: list[Upload],
        failed: list[ClientFailure],
        rejected: list[Rejection],
        findings: list[dict[str, Any]],
        stragglers: list[int],
    ) -> None:
        recorder_extra.clear()
        reports = aggregate_reports(
            [{**u.reports, **({"client": u.client} if u.client is not None else {})} for u in uploads]
        )
        if reports.totals:
            recorder_extra["defense"] = reports.totals
        if reports.uploads:
            recorder_extra["uploads"] = reports.uploads
        declared = [u.declared for u in uploads]
        for name in ("upload_bytes", "dense_bytes"):
            sizes = [size for d in declared if (size := getattr(d, name)) is not None]
            if sizes:
                recorder_extra[name] = round(sum(sizes) / len(sizes))
        recorder_extra["clients"] = len(uploads)
        if failed:
            recorder_extra["failures"] = len(failed)
            recorder_extra["failed"] = [f.row() for f in failed]
            for failure in failed:
                log.warning("round %d: %s", server_round, failure)
        if stragglers:
            recorder_extra["stragglers"] = list(stragglers)
            log.warning("round %d: clients %s sent no reply within server.round-timeout", server_round, stragglers)
        if rejected:
            recorder_extra["rejected"] = [r.row() for r in rejected]
            for r in rejected:
                log.warning("round %d: the upload of client %s is rejected: %s", server_round, r.client, r.reason)
        declined = [f for f in findings if f.get("action") in ("skip", "refuse")]
        if findings:
            recorder_extra["detect"] = findings
        for finding in declined:
            log.warning(
                "round %d: client %s declined (%s): its detectors flagged the model",
                *(server_round, finding["client"], finding["action"]),
            )
        if declined:
            recorder_extra["declined"] = len(declined)
        if not uploads and declined:
            recorder_extra["skipped"] = (
                f"no upload was left ({len(rejected)} rejected, {len(declined)} declined); the model is unchanged"
            )
        elif not uploads and rejected:
            recorder_extra["skipped"] = f"every upload was rejected ({len(rejected)}); the model is unchanged"

    return on_replies


def _attempt(what: str, step: Callable[[], Any]) -> None:
    """Run one step of a run's ending; a failure is printed with its reason (and logged with its traceback, but
    for a full disk) and the next steps still run."""
    try:
        step()
    except Exception as error:
        print(f"fedguard: {what} failed: {type(error).__name__}: {error}", flush=True)
        if not isinstance(error, RunFileUnwritable):  # a full disk is explained by its message: no traceback
            log.error("%s failed:\n%s", what, traceback.format_exc())


def close_capture(sink: FanOut, pool: AttackPool | None, wait: float, folder: Path) -> None:
    """Write the captured uploads and wait up to ``wait`` seconds for the attacks still running (not once the
    run is stopping); every attack left gets its row."""
    if pool is not None and pool.pending() and pool.stop() is None:
        print(f"fedguard: waiting up to {wait:g} s for {pool.pending()} attacks", flush=True)
    sink.close(timeout=wait)
    captured = len(list((folder / OBSERVATIONS_DIR).glob("*.npz")))
    print(f"fedguard: {captured} uploads captured in {folder / OBSERVATIONS_DIR}", flush=True)


def announce_attacks(folder: Path) -> None:
    """Print how many of the run's attack rows have each status."""
    rows = read_attacks(folder)
    print(f"fedguard: attacks: {status_counts(rows)}; results in {folder / ATTACKS_FILE}", flush=True)


def finish_run(
    folder: Path,
    config: Config,
    recorder: RoundRecorder,
    outcome: tuple[str, str],
    sink: FanOut | None,
    pool: AttackPool | None,
    stop: StopRequest,
    trackers: Trackers,
    plugin: str = "",
) -> None:
    """The ending of every run, however it stopped: ``status.json`` ('interrupted' too when a stop came while
    the attacks ran; ``plugin``: the plugin module whose code stopped it), the round log, the captured uploads and
    a row for every attack, the report, the trackers' ending. A step that fails does not keep the next ones from
    running."""
    ending = outcome[0]
    rounds = max((r["round"] for r in recorder.rows), default=0)
    _attempt("writing status.json", lambda: write_status(folder, outcome[0], rounds, outcome[1], plugin))
    _attempt("closing the round log", recorder.close)
    print(f"fedguard: {recorder.summary()}", flush=True)
    if sink is not None:
        _attempt("closing the capture", lambda: close_capture(sink, pool, config.pool.wait, folder))
        reason = stop.reason()
        if outcome[0] == "completed" and reason is not None:
            _attempt(
                "writing status.json",
                lambda: write_status(folder, "interrupted", rounds, f"{reason} while the attacks ran"),
            )
            ending = "interrupted"
    if pool is not None:
        _attempt("counting the attack rows", lambda: announce_attacks(folder))
    _attempt("writing the report", lambda: print(f"fedguard: report {build_report(folder)}", flush=True))
    _attempt("closing the trackers", lambda: trackers.finish(ending))


def run_server(grid: Grid, config: Config) -> Path:
    """Run every round on ``grid``; returns the run folder. Outputs are flushed even on failure; a stop
    request (``fedguard.runtime.stopping``) ends the run as 'interrupted', every result kept."""
    check_attack_files(config.attacks)
    check_defense_files(config.defense.name, config.defense.params)
    folder, point = starting_point(config)
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, out_dir=str(folder)))
    print(f"fedguard: run folder {folder}", flush=True)
    done = 0 if point is None else point.round
    stop = StopRequest.from_environment()
    stop_on_flower_exit(stop)
    grid = StoppableGrid(grid, stop)
    if config.server.message_index:
        index_message_delivery()
    else:
        remove_message_index()

    model = initial_model(config)
    card = model_card(config, model)
    strategy = aggregating_strategy(config, card)
    trackers = open_trackers(config, folder)
    recorder = RoundRecorder(
        folder / ROUNDS_FILE,
        config.train.rounds,
        config.train.clients_per_round,
        previous=read_rounds(folder) if point is not None else (),
        listeners=[trackers.round],
    )
    ended = watch_for_stuck_plugin(
        stop, split_names(config.server.plugins), folder, lambda: max((r["round"] for r in recorder.rows), default=0)
    )
    latest: dict[str, Any] = {}
    rounds, clients = config.capture.round_selection(), config.capture.client_selection()
    sink: FanOut | None = None
    pool: AttackPool | None = None
    outcome = ("failed", "the ServerApp stopped")
    plugin = ""
    try:
        wait_for_nodes(grid, config)
        if not (rounds.is_empty() or clients.is_empty()):
            sinks: list[Any] = [DiskSink(folder / OBSERVATIONS_DIR)]
            if config.attacks:
                pool = build_attack_pool(config, folder, stop, trackers)
                pool.warm_up()  # its workers start while the first rounds run, not after the first capture
                sinks.append(pool)
            sink = FanOut(sinks)
            strategy = capture_strategy(config, strategy, sink, card)
        strategy = RoundGuard(
            strategy, round_accounting(latest), upload_rules(config, card), seed=config.run.seed, rounds_done=done
        )
        print(f"fedguard: strategy {aggregation_line(strategy)}", flush=True)
        arrays = get_arrays(model) if point is None else resumed_arrays(card, point, model)
        if point is not None:
            restore_strategy_state(strategy, point.strategy)
        strategy.start(
            grid,
            initial_arrays=array_record(card.names, arrays),
            num_rounds=config.train.rounds - done,
            timeout=config.server.round_timeout,
            evaluate_fn=central_evaluation(config, card, recorder, latest, round_checkpoints(folder, strategy), done),
        )
        outcome = ("completed", "")
    except RunInterrupted as interruption:
        outcome = ("interrupted", str(interruption))
        print(f"fedguard: the run was {interruption}; recording the attacks left as interrupted", flush=True)
    except BaseException as error:
        blamed = raising_plugin(error, split_names(config.server.plugins))
        if blamed is None:
            outcome = ("failed", f"{type(error).__name__}: {error}")
            print(f"fedguard: the run failed: {outcome[1]}", flush=True)
            raise
        failure = PluginFailure(blamed, error)
        outcome, plugin = ("failed", str(failure)), blamed.module
        print(f"fedguard: the run failed: {failure}", flush=True)
        raise failure from None
    finally:
        ended.set()
        finish_run(folder, config, recorder, outcome, sink, pool, stop, trackers, plugin)
    return folder


def under_runs_home(config: Config, run_id: int) -> Config:
    """``config`` with the run folder of Flower run ``run_id`` (``fedguard.store.folder.flwr_run_dir``)."""
    out = flwr_run_dir(config.run.out_dir, config.run.name, run_id)
    return dataclasses.replace(config, run=dataclasses.replace(config.run, out_dir=str(out)))


def flwr_run_config(context: Context) -> Config:
    """The configuration Flower's run config holds, with the run folder of its Flower run; ``ConfigError`` for
    a file or data folder given as a relative path, which the app's processes would look for in the SuperLink's
    folder (``fedguard run`` and ``fedguard sweep`` send absolute paths)."""
    config = Config.from_run_config(context.run_config)
    problems = relative_path_problems(config)
    if problems:
        raise ConfigError(problems)
    return under_runs_home(config, context.run_id)


def make_server_app(config: Config | None = None) -> ServerApp:
    """A ServerApp bound to ``config``, or reading Flower's run config when None (``flwr run``)."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            run_server(grid, config if config is not None else flwr_run_config(context))
        except (NonFiniteModel, AllClientsFailed, RunFileUnwritable, PluginFailure):
            return  # an explained stop: run_server printed it and the run folder says 'failed', without a traceback

    return server_app


app = make_server_app()
