"""The configuration schema: every section's keys with their types, defaults, ranges and help, the chosen
components' shape, and the reading of ``threat.malicious``.

Pure data: this module imports no registry of defenses, attacks, strategies or models and builds nothing. A
key's valid values are checked where the composition root (``fedguard.config``) validates a configuration,
which also resolves the choices a field takes from a component registry (``choices_of``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fedguard.aggregate import AGGREGATIONS
from fedguard.data import DATASETS, SourceOptions
from fedguard.data.partition import PARTITIONERS, PartitionOptions
from fedguard.detect import ACTIONS
from fedguard.limits import (
    INT64_MAX,
    MAX_CLIENTS,
    MAX_IMAGE_SIZE,
    MAX_LOCAL_EPOCHS,
    MAX_LR,
    MAX_PROCESSES,
    MAX_ROUNDS,
    shown,
)
from fedguard.protocols import PROTOCOLS
from fedguard.selection import Selection

AUTO_STRATEGY = "auto"  # server.strategy: the protocol's default strategy

Scalar = bool | int | float | str
NO_ATTACK = "none"


class ConfigError(ValueError):
    """One or more configuration problems, each naming the key, the value and the valid choices."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid configuration:\n  " + "\n  ".join(problems))


def option(default: Scalar, help: str, **checks: Any) -> Any:
    """A config field with its help text and checks: ge, gt, le, lt; ``choices`` (a function giving the valid
    values) or ``choices_of`` (a component kind whose registered names they are, which the composition root,
    ``fedguard.config``, resolves)."""
    return field(default=default, metadata={"help": help, **checks})


@dataclass(frozen=True)
class RunSection:
    name: str = option("fedguard", "run name; output goes to runs/<name> unless out-dir is set")
    seed: int = option(
        0,
        "seed of partitioning, the clients sampled each round, their batches and model initialization",
        ge=0,
        le=INT64_MAX,
    )
    out_dir: str = option(
        "", "output folder (empty: runs/<name>); relative to the folder the command runs in", path=True
    )
    resume: bool = option(False, "continue the run in out-dir from its last completed round (fedguard run --resume)")


@dataclass(frozen=True)
class DataSection:
    name: str = option("mnist-5k", "dataset", choices=DATASETS.names)
    root: str = option(
        "",
        "local folder for datasets that do not ship with the packages; relative to the folder the command runs in",
        path=True,
    )
    download: bool = option(False, "let torchvision download a missing dataset (needs the network)")
    test_fraction: float = option(0.2, "held-out share for datasets without an official test split", gt=0.0, lt=1.0)
    image_size: int = option(32, "side in pixels for the photos and imagefolder sources", ge=8, le=MAX_IMAGE_SIZE)

    def source_options(self) -> SourceOptions:
        """The loader's view of this section."""
        return SourceOptions(self.root, self.download, self.test_fraction, self.image_size)


@dataclass(frozen=True)
class PartitionSection:
    name: str = option("iid", "how training data is split among clients", choices=PARTITIONERS.names)
    num_clients: int = option(10, "number of clients (simulated SuperNodes)", ge=1, le=MAX_CLIENTS)
    alpha: float = option(0.5, "Dirichlet concentration for partition.name = 'dirichlet'", gt=0.0)
    classes_per_client: int = option(2, "classes each client holds for partition.name = 'classes'", ge=1)
    max_per_client: int = option(0, "most samples a client keeps, a seeded draw from its share (0 = all)", ge=0)

    def options(self) -> PartitionOptions:
        """The partitioner's view of this section."""
        return PartitionOptions(self.alpha, self.classes_per_client, self.max_per_client)


@dataclass(frozen=True)
class TrainSection:
    protocol: str = option(
        "fedsgd",
        "the federated protocol: fedsgd, one batch gradient per client; fedavg, local epochs, weights uploaded; "
        "or a plugin's (fedguard.protocols)",
        choices=PROTOCOLS.names,
    )
    rounds: int = option(20, "number of federated rounds", ge=1, le=MAX_ROUNDS)
    clients_per_round: int = option(10, "clients sampled in each round", ge=1, le=MAX_CLIENTS)
    batch_size: int = option(32, "samples per client batch", ge=1)
    lr: float = option(
        0.5, "learning rate: the server's SGD step (fedsgd) or the clients' local SGD (fedavg)", gt=0.0, lt=MAX_LR
    )
    local_epochs: int = option(1, "local epochs per round (fedavg)", ge=1, le=MAX_LOCAL_EPOCHS)
    fedbn: bool = option(
        False,
        "FedBN: every BatchNorm layer stays on its client (its weights, biases and running statistics are "
        "kept, trained and never sent; the server gets back what it sent there)",
    )


@dataclass(frozen=True)
class CaptureSection:
    rounds: str = option("1", "rounds whose uploads the server captures: 'all', 'none', '1,3,5-7'")
    clients: str = option("all", "client (partition) ids whose uploads are captured: 'all', 'none', '0,2-4'")
    per_round: int = option(
        0,
        "at most this many uploads captured a round, those of the lowest client ids among the targeted ones the "
        "round sampled (0: all of them)",
        ge=0,
    )
    ground_truth: bool = option(
        True,
        "clients of targeted rounds write their true batch to the run's vault for "
        "scoring (simulation; never shown to the attacker)",
    )

    def round_selection(self) -> Selection:
        return Selection.parse(self.rounds, "capture.rounds")

    def client_selection(self) -> Selection:
        return Selection.parse(self.clients, "capture.clients")


@dataclass(frozen=True)
class ThreatSection:
    labels: bool = option(False, "the server knows the true labels of each batch (otherwise attacks infer them)")
    bn_statistics: bool = option(False, "the server knows the BatchNorm statistics of each batch")
    hyperparameters: bool = option(True, "the server may use the local hyper-parameters clients declare")
    defense: bool = option(
        False, "the server knows the clients' defense and its parameters, not its randomness (needed by EOT attacks)"
    )
    malicious: str = option(
        "",
        "rounds in which a malicious server manipulates the model it sends, as "
        "round:manipulation pairs, e.g. '2:trap-weights, 3:imprint, 4-9:feature-fishing' ('': an honest server)",
    )
    aggregation: str = option(
        "plain",
        "what the server sees of a round: 'plain' (every client's upload) or 'secure' (secure aggregation: only "
        "the example-weighted mean of the round's defended uploads, captured as one upload of every client's images)",
        choices=lambda: AGGREGATIONS,
    )

    def schedule(self) -> dict[int, str]:
        """Round -> manipulation name (checked against the registered ones when the configuration was built);
        raises ``ValueError`` naming a bad pair."""
        return parse_schedule(self.malicious)

    def model(self) -> str:
        """The server's threat model: 'malicious' when it manipulates the model it sends in some round, else
        'honest' (honest but curious); ', secure aggregation' added when it sees only each round's aggregate."""
        server = "malicious" if self.malicious.strip() else "honest"
        return f"{server}, secure aggregation" if self.aggregation == "secure" else server

    def granted(self) -> set[str]:
        """The grants, named as attacks name their needs."""
        flags = {
            "labels": self.labels,
            "bn-statistics": self.bn_statistics,
            "hyperparameters": self.hyperparameters,
            "defense": self.defense,
        }
        return {name for name, granted in flags.items() if granted}


def parse_schedule(text: str, known: Callable[[], list[str]] | None = None) -> dict[int, str]:
    """'2:trap-weights, 3:imprint, 5-7:feature-fishing' -> {2: 'trap-weights', 3: 'imprint', 5: 'feature-fishing',
    6: ..., 7: ...}; '' -> {}. With ``known`` (the registered manipulations' names) a name not among them is
    refused; raises ``ValueError`` naming the bad pair."""
    schedule: dict[int, str] = {}
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        rounds_text, _, name = (part.strip() for part in piece.partition(":"))
        first_text, dash, last_text = (part.strip() for part in rounds_text.partition("-"))
        first = _schedule_round(first_text, piece)
        last = _schedule_round(last_text, piece) if dash else first
        if last < first:
            raise ValueError(f"threat.malicious: {shown(piece)}: the rounds {first}-{last} run backwards")
        if not name:
            raise ValueError(f"threat.malicious: {shown(piece)} is not round:manipulation (e.g. '2:trap-weights')")
        if known is not None and name not in known():
            raise ValueError(
                f"threat.malicious: manipulation {shown(name)} in {shown(piece)}: choose one of {', '.join(known())}"
            )
        for round_ in range(first, last + 1):
            if round_ in schedule:
                raise ValueError(f"threat.malicious: round {round_} is manipulated twice")
            schedule[round_] = name
    return schedule


def _schedule_round(text: str, piece: str) -> int:
    """The round of a ``threat.malicious`` piece: decimal digits, 1 to ``MAX_ROUNDS``."""
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"threat.malicious: {shown(piece)} is not round:manipulation (e.g. '2:trap-weights')")
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(MAX_ROUNDS)) or not 1 <= int(digits) <= MAX_ROUNDS:
        raise ValueError(f"threat.malicious: round {shown(text)} in {shown(piece)}: rounds are 1 to {MAX_ROUNDS}")
    return int(digits)


@dataclass(frozen=True)
class DetectSection:
    action: str = option(
        "report",
        "what a client does with a model a detector flagged: report (train and upload as usual), skip (reply with "
        "its findings and no upload) or refuse (reply with an error whose reason holds its findings)",
        choices=lambda: ACTIONS,
    )


@dataclass(frozen=True)
class PoolSection:
    workers: int = option(1, "attacker worker processes (one GPU each when CUDA is visible)", ge=1, le=MAX_PROCESSES)
    time_limit: float = option(900.0, "seconds one captured upload may take before its worker is restarted", gt=0.0)
    wait: float = option(1800.0, "seconds to wait after the last round for attacks still running", ge=0.0)
    group: int = option(4, "most captured uploads of one shape a worker attacks in one batch", ge=1, le=MAX_PROCESSES)
    threads: int = option(1, "torch threads of each CPU worker", ge=1, le=MAX_PROCESSES)
    address: str = option("", "Ray cluster to join when none is running ('' = the simulation's or a new local one)")


@dataclass(frozen=True)
class ServerSection:
    strategy: str = option(
        AUTO_STRATEGY,
        "how the server aggregates: 'auto' (fedsgd for train.protocol = 'fedsgd', "
        "fedavg for 'fedavg') or a registered strategy",
        choices_of="strategy",
    )
    connect_timeout: float = option(
        10.0,
        "seconds the server waits for one SuperNode per client before it stops and says how to fix the federation",
        gt=0.0,
    )
    round_timeout: float = option(
        3600.0,
        "seconds the server waits for a round's replies; a client that has not replied by then is a straggler, "
        "left out of the round and named in its row of rounds.jsonl (stragglers)",
        gt=0.0,
    )
    message_index: bool = option(
        True,
        "simulation: hand each client its messages through a per-node index of "
        "Flower's in-memory message store (fedguard.runtime.message_index) instead of "
        "Flower's scan of every stored message for every node, 10 times a second",
    )
    plugins: str = option(
        "",
        "modules imported before the configuration is checked, comma-separated: they "
        "register strategies, defenses or attacks of your own",
    )
    plugin_params: str = option(
        "",
        "parameters of plugins as space-separated key=value pairs, e.g. "
        "'server.my-strategy.clip=0.5': flwr run passes only the keys pyproject.toml "
        "declares, so undeclared keys travel here",
    )


@dataclass(frozen=True)
class TrackSection:
    tensorboard: bool = option(
        False,
        "write TensorBoard event files to <run>/tensorboard as the run goes: the "
        "configuration, accuracy and loss per round, every attack's scores and "
        "images (tensorboard --logdir runs)",
    )
    mlflow: bool = option(
        False, "log the same to MLflow: one MLflow run in track.mlflow-experiment at track.mlflow-uri"
    )
    mlflow_uri: str = option(
        "",
        "MLflow tracking URI, e.g. http://127.0.0.1:5000 ('' = a local store in the "
        "run folder: mlflow.db and mlflow-artifacts/)",
    )
    mlflow_experiment: str = option("fedguard", "MLflow experiment the run is logged in (created when missing)")
    mlflow_parent: str = option(
        "",
        "id of the MLflow run this run is nested under ('' = none; fedguard sweep sets it to the sweep's run)",
    )


@dataclass(frozen=True)
class SimSection:
    num_cpus: int = option(2, "CPU cores Ray may use", ge=1)
    client_cpus: int = option(
        1, "CPU cores reserved for each simulated client (whole cores, as Flower's client-resources-num-cpus)", ge=1
    )
    client_gpus: float = option(0.0, "GPU share reserved for each simulated client", ge=0.0)
    address: str = option(
        "",
        "Ray cluster to run the simulation on, e.g. 10.0.0.5:6379 ('' = a new local one; "
        "num-cpus is then the cluster's)",
    )


@dataclass(frozen=True)
class Component:
    """A registered component chosen by name, with its parameter dataclass instance."""

    name: str
    params: Any


SECTIONS: dict[str, type] = {
    "": RunSection,
    "data": DataSection,
    "partition": PartitionSection,
    "train": TrainSection,
    "capture": CaptureSection,
    "threat": ThreatSection,
    "detect": DetectSection,
    "pool": PoolSection,
    "sim": SimSection,
    "server": ServerSection,
    "track": TrackSection,
}


STRATEGY_PREFIX = "server"  # server.<strategy>.<parameter>


def param_key(kind: str, name: str, field_name: str) -> str:
    """The key of a component's parameter: ``<kind>.<name>.<field-name>`` (``defense.dp.noise-multiplier``)."""
    return f"{kind}.{name}.{field_name.replace('_', '-')}"


def settings_text(kind: str, name: str, given: Mapping[str, Any]) -> str:
    """'defense.dp.clip = 0.5, defense.dp.epsilon = 2.0': the keys ``given`` (field -> value) sets."""
    return ", ".join(f"{param_key(kind, name, field)} = {shown(value)}" for field, value in given.items())
