"""The checks of a configuration that look across its sections: capture and attack against the schedule, data
sizes against batches and classes, each model against its data, defenses and attacks against the protocol and the
model, files on disk. ``fedguard.config`` (the composition root) calls ``cross_checks`` once every section and
component is built; each check returns its problems as messages that name the keys and the valid choices."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from attackers.base import ATTACKS, AttackTraits, attack_traits, missing_grants, required_manipulation
from attackers.manipulation import HONEST, MANIPULATIONS, ClientManipulation, build_manipulation
from fedguard.data import DATASETS, DatasetNotFoundError, DataSpec
from fedguard.data.partition import PARTITIONERS, PartitionOptions
from fedguard.data.partition import partition as split_among_clients
from fedguard.data.registry import ROOTED, dataset_spec
from fedguard.data.sizes import samples_needed, split_sizes, train_class_counts
from fedguard.defenses.base import defense_traits
from fedguard.defenses.dp_sgd import DPSGDParams
from fedguard.limits import (
    MAX_LISTED,
    RUN_FILES_RESERVE,
    name_problem,
    path_problem,
    shown,
)
from fedguard.memory import RunMemory, activation_bytes, machine_bytes, model_bytes, size_text
from fedguard.models import build_model
from fedguard.observation import ModelCard
from fedguard.protocols import PROTOCOLS
from fedguard.protocols import protocol as run_protocol
from fedguard.registry import RequiredFile
from fedguard.schema import AUTO_STRATEGY as AUTO_STRATEGY  # the schema's names, read from here too
from fedguard.schema import (
    STRATEGY_PREFIX,
    CaptureSection,
    Component,
    DataSection,
    PartitionSection,
    RunSection,
    SimSection,
    TrackSection,
    TrainSection,
    param_key,
    parse_schedule,
    settings_text,
)
from fedguard.spans import Spans, describe
from fedguard.training import trainable_mask
from strategies.registry import STRATEGIES
from strategies.registry import min_replies as strategy_min_replies
from strategies.registry import resolve as resolve_strategy


def _usable(invalid: set[str], *keys: str) -> bool:
    """Whether every one of ``keys`` holds a valid value (a check between keys reads only valid values)."""
    return not invalid.intersection(keys)


@dataclass(frozen=True)
class CapturedRounds:
    """The rounds whose uploads the server captures: those ``spans`` chooses among 1..``rounds``."""

    spans: Spans
    rounds: int

    def __contains__(self, round_: int) -> bool:
        return 1 <= round_ <= self.rounds and round_ in self.spans

    def count(self) -> int:
        """How many rounds are captured."""
        return self.spans.count(1, self.rounds)


def cross_checks(sections: dict[str, Any], invalid: set[str]) -> list[str]:
    """Problems between keys, each checked when the keys it reads hold valid values."""
    problems = []
    train, partition = sections["train"], sections["partition"]
    if (
        _usable(invalid, "train.clients-per-round", "partition.num-clients")
        and train.clients_per_round > partition.num_clients
    ):
        problems.append(
            f"train.clients-per-round = {train.clients_per_round}: must be <= partition.num-clients "
            f"({partition.num_clients})"
        )
    data_problems = _data_problems(sections["data"], partition, invalid)
    sizes, partition_problems = (None, []) if data_problems else _client_sizes(sections, invalid)
    problems += data_problems + partition_problems
    problems += _path_problems(sections["run"], sections["data"])
    captured, capture_problems = _capture_problems(sections["capture"], train, partition, invalid)
    problems += capture_problems
    capture = sections["capture"]
    if sections["threat"].aggregation == "secure" and capture.clients.strip().lower() != "all":
        problems.append(
            f"threat.aggregation = 'secure': each round's aggregate holds the images of every client of the round, "
            f"and is scored against all their batches; set capture.clients = 'all' (got {shown(capture.clients)})"
        )
    try:
        schedule: dict[int, str] | None = parse_schedule(sections["threat"].malicious, MANIPULATIONS.names)
    except ValueError:
        schedule = None  # reported with the components
    if schedule is not None and captured is not None:
        uncaptured = sorted(r for r in schedule if r not in captured)
        if uncaptured:
            which = f"round {uncaptured[0]}" if len(uncaptured) == 1 else f"rounds {', '.join(map(str, uncaptured))}"
            problems.append(
                f"threat.malicious manipulates {which}, which {'is' if len(uncaptured) == 1 else 'are'} not "
                f"captured in this run (capture.rounds = {shown(sections['capture'].rounds)}, "
                f"train.rounds = {train.rounds})"
            )
    defense = sections["defense"]
    problems += _chosen_by("defense", defense.name, _defense_problems(defense, train.protocol, sections))
    attack_names = ",".join(a.name for a in sections["attacks"])
    for attack in sections["attacks"]:
        problems += _chosen_by("attack", attack_names, _attack_problems(attack, sections, schedule, captured))
    problems += _model_fit_problems(sections, invalid, sizes)
    problems += _sample_rate_problems(defense, train, sizes, invalid)
    problems += _strategy_problems(sections, invalid)
    problems += _track_problems(sections["track"])
    problems += _place_problems(sections["data"], sections["sim"], invalid)
    problems += _detect_problems(sections, invalid)
    return problems


def _detect_problems(sections: dict[str, Any], invalid: set[str]) -> list[str]:
    """D-SNR compares an example's gradient with the others': it needs batches of two or more."""
    chosen = [d.name for d in sections["detectors"]]
    batch = sections["train"].batch_size
    if "dsnr" in chosen and _usable(invalid, "train.batch-size") and batch < 2:
        return [
            f"detect.name = {shown(','.join(chosen))}: dsnr compares each example's gradient with the rest of the "
            f"batch, train.batch-size = {batch} gives it one; set train.batch-size >= 2 or drop dsnr"
        ]
    return []


def _chosen_by(kind: str, names: str, problems: list[str]) -> list[str]:
    """``problems`` of a chosen component, each naming the key that chose it."""
    key = f"{kind}.name"
    return [p if key in p else f"{p} ({key} = {shown(names)})" for p in problems]


def _capture_problems(
    capture: CaptureSection, train: TrainSection, partition: PartitionSection, invalid: set[str]
) -> tuple[CapturedRounds | None, list[str]]:
    """The captured rounds (None when ``train.rounds`` is invalid) and what is wrong with ``capture.rounds`` and
    ``capture.clients``: unreadable, too long to expand, naming rounds or clients the run does not have, or
    capturing rounds of no client. Counted on intervals: nothing is expanded."""
    problems: list[str] = []
    rounds_known = _usable(invalid, "train.rounds")
    clients_known = _usable(invalid, "partition.num-clients")
    rounds = _read_spans(
        capture.rounds,
        "capture.rounds",
        1,
        train.rounds if rounds_known else None,
        f"this run's rounds are 1-{train.rounds} (train.rounds = {train.rounds})",
        problems,
    )
    last = partition.num_clients - 1
    clients = _read_spans(
        capture.clients,
        "capture.clients",
        0,
        last if clients_known else None,
        f"client ids are 0-{last} (partition.num-clients = {partition.num_clients})",
        problems,
    )
    if (
        rounds is not None
        and clients is not None
        and rounds_known
        and clients_known
        and rounds.count(1, train.rounds)
        and clients.is_empty()
    ):
        problems.append(
            f"capture.clients = {shown(capture.clients)} selects no client, so capture.rounds = "
            f"{shown(capture.rounds)} captures nothing: choose client ids among 0-"
            f"{partition.num_clients - 1}, or set capture.rounds = 'none'"
        )
    if not rounds_known:
        return None, problems
    every = Spans.parse("all", "capture.rounds")  # an unusable capture.rounds was reported: do not blame attacks
    return CapturedRounds(rounds if rounds is not None else every, train.rounds), problems


def _read_spans(spec: str, key: str, low: int, high: int | None, valid: str, problems: list[str]) -> Spans | None:
    """``spec`` read as intervals, checked to lie in [``low``, ``high``] (None: the bound is unknown) and to list
    at most ``MAX_LISTED`` integers; None when it cannot be used (reported in ``problems``)."""
    try:
        spans = Spans.parse(spec, key)
    except ValueError as error:
        problems.append(str(error))
        return None
    outside = spans.outside(low, high) if high is not None else ()
    if outside:
        problems.append(f"{key} = {shown(spec)}: {describe(outside)} not in this run; {valid}")
        return None
    if spans.listed > MAX_LISTED:
        problems.append(f"{key} = {shown(spec)}: lists {spans.listed} integers (repeats counted); at most {MAX_LISTED}")
        return None
    return spans


DATA_KEYS = (
    "data.name",
    "data.test-fraction",
    "data.image-size",
    "partition.name",
    "partition.num-clients",
    "partition.classes-per-client",
)


def _data_problems(data: DataSection, partition: PartitionSection, invalid: set[str]) -> list[str]:
    """What the data set's static sizes and classes say against the partition (nothing is loaded: see
    ``fedguard.data.sizes``; an image folder is checked when it is loaded)."""
    if not _usable(invalid, *DATA_KEYS):
        return []
    problems = _classes_problems(data, partition)
    sizes = split_sizes(data.name, data.source_options())
    if sizes is None:
        return problems
    setting = ", ".join(
        [
            f"data.name = {data.name!r}",
            *(f"{key} = {getattr(data, key.split('.')[1].replace('-', '_'))!r}" for key in sizes.depends_on),
        ]
    )
    if sizes.train + sizes.test == 0:
        return problems + [f"{setting}: the data set holds no samples at these settings"]
    if sizes.test == 0:
        problems.append(
            f"{setting}: leaves the test split empty, and the server evaluates the global model on "
            f"it: choose a larger data.test-fraction"
        )
    needed = samples_needed(partition.name, partition.num_clients)
    if sizes.train < needed:
        per_client = needed // partition.num_clients
        remedies = [f"at most {sizes.train // per_client} clients"] if sizes.train >= per_client else []
        remedies += ["a smaller data.test-fraction"] if "data.test-fraction" in sizes.depends_on else []
        problems.append(
            f"{setting} leaves {sizes.train} training samples for partition.num-clients = "
            f"{partition.num_clients}, and partition.name = {partition.name!r} needs {per_client} per "
            f"client: choose {' or '.join(remedies) or 'another data set'}"
        )
    return problems


def _classes_problems(data: DataSection, partition: PartitionSection) -> list[str]:
    """``partition.classes-per-client`` beyond the data set's classes, for partition.name = 'classes'."""
    spec = dataset_spec(data.name, data.source_options()) if partition.name == "classes" else None
    if spec is None or partition.classes_per_client <= spec.num_classes:
        return []
    return [
        f"partition.classes-per-client = {partition.classes_per_client}: data.name = {data.name!r} has "
        f"{spec.num_classes} classes; choose 1 to {spec.num_classes}"
    ]


PARTITION_KEYS = (*DATA_KEYS, "seed", "partition.alpha", "partition.max-per-client")


def _client_sizes(sections: dict[str, Any], invalid: set[str]) -> tuple[list[int] | None, list[str]]:
    """Each client's number of training samples, from the built-in partitioner run on labels of the data set's
    known per-class training counts (its sizes follow from the counts and the seed alone; an iid split needs only
    the total), and why the partitioner refuses (e.g. no Dirichlet draw gives every client its minimum); None when
    only loading the data tells."""
    data, partition, seed = sections["data"], sections["partition"], sections["run"].seed
    built_in = PARTITIONERS.get(partition.name).factory.__module__ == split_among_clients.__module__
    if not _usable(invalid, *PARTITION_KEYS) or not built_in:  # a plugin's may read more than the counts
        return None, []
    counts = train_class_counts(data.name, data.source_options())
    split = split_sizes(data.name, data.source_options())
    if counts is None and partition.name == "iid" and split is not None:
        counts = (split.train,)  # the iid split ignores the labels
    if counts is None:
        return None, []
    try:
        sizes = share_sizes(tuple(counts), partition.num_clients, partition.name, partition.options(), seed)
    except ValueError as error:
        return None, [
            f"data.name = {data.name!r}, partition.name = {partition.name!r}, partition.num-clients = "
            f"{partition.num_clients}: {error}"
        ]
    return list(sizes), []


@functools.lru_cache(maxsize=256)
def share_sizes(
    counts: tuple[int, ...], num_clients: int, scheme: str, options: PartitionOptions, seed: int
) -> tuple[int, ...]:
    """Each client's number of samples when the built-in ``scheme`` splits a training set of ``counts`` samples
    per class; kept per arguments, since a sweep's runs differ mostly in what does not move the split (a
    Dirichlet split of 100 clients takes about 1 s). ``ValueError`` as the partitioner raises it."""
    labels = np.repeat(np.arange(len(counts)), counts)
    with warnings.catch_warnings():  # the partitioner's notes (e.g. classes no client holds) are the run's
        warnings.simplefilter("ignore")
        shares = split_among_clients(labels, num_clients, scheme, options, seed)
    return tuple(len(share) for share in shares)


def _model_fit_problems(sections: dict[str, Any], invalid: set[str], sizes: list[int] | None) -> list[str]:
    """What the run's model, built on the meta device (shapes, no values) for the data set's static spec, cannot
    do in this run: take the data set's images, train on the batches the clients make of their ``sizes``, be
    rewritten by the manipulations ``threat.malicious`` schedules, or be attacked by a chosen attack (its traits'
    ``check_model``)."""
    data, model = sections["data"], sections["model"]
    spec = dataset_spec(data.name, data.source_options()) if _usable(invalid, *DATA_KEYS) else None
    if spec is None or model.params is None:
        return []  # known once the data are loaded, or reported already
    try:
        with torch.device("meta"):
            net = build_model(model.name, spec, model.params)
    except ValueError as error:
        shape = "x".join(map(str, spec.shape))
        return [f"model.name = {model.name!r} cannot take data.name = {data.name!r} ({shape} images): {error}"]
    except RuntimeError as error:  # sizes whose byte count overflows a 64-bit integer
        return [f"{_model_settings(model)}: a model too large for any machine ({error})"]
    problems = _batch_problems(net, spec, sections, invalid, sizes) + _fedbn_problems(net, sections)
    memory = _memory_problems(net, spec, sections, invalid, sizes)
    if not memory:  # the manipulation check builds zero arrays of the model's shapes
        problems += _manipulation_problems(net, spec, sections, sizes)
    return memory + problems + _attack_model_problems(net, sections)


def _changed(component: Component) -> dict[str, Any]:
    """``component``'s parameters that differ from their defaults (field -> value)."""
    defaults = dataclasses.asdict(type(component.params)())
    return {k: v for k, v in dataclasses.asdict(component.params).items() if v != defaults[k]}


def _model_settings(model: Component) -> str:
    """'model.name = 'mlp', model.mlp.hidden = 50000': the model and the parameters that differ from their
    defaults."""
    changed = _changed(model)
    named = f"model.name = {model.name!r}"
    return f"{named}, {settings_text('model', model.name, changed)}" if changed else named


def _memory_problems(
    net: nn.Module, spec: DataSpec, sections: dict[str, Any], invalid: set[str], sizes: list[int] | None
) -> list[str]:
    """The run's least memory (``fedguard.memory``) against what this machine has: a refusal naming the keys
    that set it, or nothing."""
    train, sim, partition = sections["train"], sections["sim"], sections["partition"]
    keys = ("train.clients-per-round", "train.batch-size", "sim.num-cpus", "sim.client-cpus", "sim.address")
    if not _usable(invalid, *keys, "partition.max-per-client"):
        return []
    held = max(sizes) if sizes else partition.max_per_client or train.batch_size
    local = 0 if sim.address else min(train.clients_per_round, max(1, sim.num_cpus // sim.client_cpus))
    workers = sections["pool"].workers if sections["attacks"] else 0
    need = RunMemory(
        weights=model_bytes(net),
        activations=activation_bytes(net, spec.shape),
        batch=min(train.batch_size, held),
        clients=local,
        uploads=train.clients_per_round,
        workers=workers,
    )
    have = machine_bytes()
    if need.total <= have:
        return []
    parts = [f"{size_text(need.weights)} of weights"]
    if local:
        parts.append(
            f"{local} client{'s' * (local > 1)} training at once at {size_text(need.client_bytes)} each "
            f"(train.clients-per-round = {train.clients_per_round}, sim.num-cpus = {sim.num_cpus}, "
            f"sim.client-cpus = {sim.client_cpus}, train.batch-size = {train.batch_size})"
        )
    parts.append(f"the server with {train.clients_per_round} uploads a round")
    if workers:
        parts.append(f"{workers} attack worker{'s' * (workers > 1)} (pool.workers)")
    return [
        f"{_model_settings(sections['model'])}: the run needs at least {size_text(need.total)} "
        f"({'; '.join(parts)}), and this machine has {size_text(have)}; choose a smaller model, or fewer clients "
        f"at once"
    ]


def _attack_model_problems(net: nn.Module, sections: dict[str, Any]) -> list[str]:
    """Each chosen attack's ``check_model`` on the run's model: why the attack cannot attack it (with the
    attack's parameters that differ from their defaults)."""
    problems, names = [], ",".join(a.name for a in sections["attacks"])
    for attack in sections["attacks"]:
        check = attack_traits(attack.name, attack.params).check_model
        try:
            if check is not None:
                check(net)
        except ValueError as error:
            changed = _changed(attack)
            settings = f" ({settings_text('attack', attack.name, changed)})" if changed else ""
            problem = f"attack.{attack.name} with model.name = {sections['model'].name!r}: {error}{settings}"
            problems += _chosen_by("attack", names, [problem])
    return problems


def _has_batch_norm(net: nn.Module) -> bool:
    """Whether ``net`` holds a BatchNorm layer."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())


def _batch_problems(
    net: nn.Module, spec: DataSpec, sections: dict[str, Any], invalid: set[str], sizes: list[int] | None
) -> list[str]:
    """A BatchNorm model's training forward pass (on the meta device) at each batch size the clients train on:
    ``train.batch-size`` or a client's smaller share, and under a protocol of several batches the last one of an
    epoch; a BatchNorm layer needs more than one value per channel."""
    train, partition = sections["train"], sections["partition"]
    keys = ("train.batch-size", "train.protocol", "partition.max-per-client")
    if not _usable(invalid, *keys) or not _has_batch_norm(net):
        return []
    size = train.batch_size
    held = sizes if sizes is not None else [min(size, partition.max_per_client or size)]
    batches = {min(size, n) for n in held if n}
    if not run_protocol(train.protocol).one_batch:
        batches |= {n % size for n in held if n % size}
    for batch in sorted(batches):
        try:
            with torch.device("meta"), torch.no_grad():
                net.train()(torch.zeros(batch, *spec.shape))
        except (RuntimeError, NotImplementedError):
            return []  # a module that reads values meta tensors lack: the run tells
        except ValueError as error:
            return [
                f"model.name = {sections['model'].name!r} cannot train on a batch of {batch}, which this run "
                f"makes (train.batch-size = {size}, partition.max-per-client = {partition.max_per_client}, "
                f"train.protocol = {train.protocol!r}, {_held(sizes)}): {error}; choose batch sizes that leave "
                f"no batch of {batch}, or a model without BatchNorm"
            ]
    return []


def _fedbn_problems(net: nn.Module, sections: dict[str, Any]) -> list[str]:
    """``train.fedbn`` on a model without a BatchNorm layer: nothing would stay on the clients."""
    if not sections["train"].fedbn or _has_batch_norm(net):
        return []
    return [
        f"train.fedbn = true: {_model_settings(sections['model'])} has no BatchNorm layer to keep on the clients; "
        "choose a model with BatchNorm (model.mlp.batch-norm = true, convnet, resnet18) or train.fedbn = false"
    ]


def _held(sizes: list[int] | None) -> str:
    """'clients hold 399-401 samples' (or that their sizes are known once the data are loaded)."""
    if sizes is None:
        return "client shares known once the data are loaded"
    low, high = min(sizes), max(sizes)
    return f"clients hold {low} samples" if low == high else f"clients hold {low}-{high} samples"


def _manipulation_problems(
    net: nn.Module, spec: DataSpec, sections: dict[str, Any], sizes: list[int] | None
) -> list[str]:
    """Each manipulation ``threat.malicious`` schedules, run (or checked, for a search across rounds) on zero arrays
    of the model's shapes: why it cannot rewrite this model (e.g. no Linear layer on the flattened image, more
    bins than units), or why a search's clients do not upload one unchanging batch (``_same_batch_problems``)."""
    model, threat, data = sections["model"], sections["threat"], sections["data"]
    if not any(m.params is not None for m in sections["manipulations"]):
        return []
    state = net.state_dict()
    names, trainable = tuple(state), tuple(trainable_mask(net))
    card = ModelCard(
        model.name, dataclasses.asdict(model.params), spec, names, trainable, data.name, data.source_options()
    )
    arrays = [np.zeros(tuple(t.shape), np.float32 if t.is_floating_point() else np.int64) for t in state.values()]
    problems = []
    for manipulation in sections["manipulations"]:
        if manipulation.params is None:
            continue  # reported already
        try:
            built = build_manipulation(manipulation.name, manipulation.params)
            if isinstance(built, ClientManipulation):
                built.check(arrays, card)
                problems += _same_batch_problems(manipulation.name, sections, sizes)
            else:
                built(arrays, card, np.random.default_rng(0))
        except DatasetNotFoundError:
            continue  # data the manipulation fits to that is absent here: the run's start reports it
        except ValueError as error:
            values = dataclasses.asdict(manipulation.params)
            settings = settings_text("manipulation", manipulation.name, values)
            problems.append(
                f"threat.malicious = {shown(threat.malicious)}: manipulation {manipulation.name!r} cannot rewrite "
                f"model.name = {model.name!r} for data.name = {sections['data'].name!r}: {error}"
                + (f" ({settings})" if settings else "")
            )
    return problems


def _same_batch_problems(name: str, sections: dict[str, Any], sizes: list[int] | None) -> list[str]:
    """Why the clients of a search across rounds (``ClientManipulation``) would not upload the gradient of one
    unchanging batch: a protocol of several batches or weights, or a client holding more than ``train.batch-size``
    samples (its batch is then drawn anew each round)."""
    train, partition = sections["train"], sections["partition"]
    if not run_protocol(train.protocol).one_batch or run_protocol(train.protocol).upload_kind != "gradient":
        return [
            f"manipulation {name!r} needs one batch gradient per upload: train.protocol = 'fedsgd', "
            f"not {train.protocol!r}"
        ]
    held = max(sizes) if sizes is not None else partition.max_per_client
    if held and held <= train.batch_size:
        return []
    return [
        f"manipulation {name!r} compares uploads of one batch across rounds, and clients holding more than "
        f"train.batch-size = {train.batch_size} samples draw a new batch each round ({_held(sizes)}, "
        f"partition.max-per-client = {partition.max_per_client}); set partition.max-per-client to at most "
        f"{train.batch_size}"
    ]


def _sample_rate_problems(
    defense: Component, train: TrainSection, sizes: list[int] | None, invalid: set[str]
) -> list[str]:
    """DP-SGD's ``dataset-size`` N below a batch B a client draws: its sampling rate q = B / N would exceed 1
    (checked where the clients' shares are known)."""
    params = defense.params
    if not isinstance(params, DPSGDParams) or not params.dataset_size or sizes is None:
        return []
    largest = max((min(train.batch_size, n) for n in sizes), default=0)
    if not _usable(invalid, "train.batch-size") or params.dataset_size >= largest:
        return []
    return [
        f"defense.{defense.name}.dataset-size = {params.dataset_size}: clients draw batches of up to {largest} "
        f"samples (train.batch-size = {train.batch_size}, {_held(sizes)}), and the sampling rate B / N cannot "
        f"exceed 1: set it to the clients' data set size, at least {largest}, or 0 (each client's own size)"
    ]


def _strategy_problems(sections: dict[str, Any], invalid: set[str]) -> list[str]:
    """A strategy that would never aggregate: one that needs more replies a round than a round has (Flower's
    Bulyan skips every round with fewer than 4 f + 3 and leaves the model as it was), or whose clients' proximal
    term diverges (FedProx: ``train.lr * proximal-mu`` of 2 or more, ``fedguard.limits``)."""
    train, strategy = sections["train"], sections["strategy"]
    name = resolve_strategy(sections["server"].strategy, train.protocol)
    if name not in STRATEGIES or strategy.params is None:
        return []
    problems = []
    mu = getattr(strategy.params, "proximal_mu", 0.0)
    if _usable(invalid, "train.lr") and train.lr * mu >= 2:
        problems.append(
            f"{param_key(STRATEGY_PREFIX, name, 'proximal_mu')} = {shown(mu)} with train.lr = {shown(train.lr)}: "
            f"train.lr * proximal-mu must be < 2 (each local step multiplies the distance to the global model by "
            f"1 - lr * mu, which grows without bound from 2 on: every upload would turn non-finite)"
        )
    needed = strategy_min_replies(name, strategy.params)
    if not _usable(invalid, "train.clients-per-round") or train.clients_per_round >= needed:
        return problems
    settings = settings_text(STRATEGY_PREFIX, name, dataclasses.asdict(strategy.params))
    return problems + [
        f"{settings + ': ' if settings else ''}server.strategy = {shown(name)} aggregates a round only from "
        f"{needed} replies on, and train.clients-per-round = {train.clients_per_round}: no round would change the "
        f"model; choose train.clients-per-round >= {needed}" + (" or other parameters" if settings else "")
    ]


def _track_problems(track: TrackSection) -> list[str]:
    """An MLflow experiment without a name (MLflow refuses it, and the run would go on untracked)."""
    if track.mlflow and not track.mlflow_experiment.strip():
        return [
            f"track.mlflow-experiment = {shown(track.mlflow_experiment)}: MLflow needs an experiment name "
            f"(track.mlflow = true)"
        ]
    return []


def ray_address_problem(address: str, key: str) -> str | None:
    """Why ``address`` (of ``key``) cannot name a Ray cluster: ``auto``, ``host:port`` or ``ray://host:port``."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if address == "auto" or (sep and host and port.isdigit()):
        return None
    return f"{key} = {address!r}: not a Ray cluster address; write host:port, ray://host:port or auto"


def _place_problems(data: DataSection, sim: SimSection, invalid: set[str]) -> list[str]:
    """Places a run cannot use, whatever the machine: no ``data.root`` for a data set that loads from it only, a
    ``sim.address`` that is not an address (whether a cluster answers there is checked when the run starts)."""
    problems = []
    if _usable(invalid, "data.name", "data.root") and data.name in ROOTED and not data.root:
        problems.append(
            f"data.root = '': data.name = {data.name!r} does not ship with the packages; set data.root to the "
            f"folder that holds it (data.download = true lets torchvision fetch it there)"
        )
    if _usable(invalid, "sim.address") and sim.address and (problem := ray_address_problem(sim.address, "sim.address")):
        problems.append(problem)
    return problems


def _path_problems(run: RunSection, data: DataSection) -> list[str]:
    """Paths that cannot name a folder here: the run folder (with room for the files the run writes inside it)
    and ``data.root``."""
    problems = [name_problem("name", run.name)]
    if run.out_dir:
        problems.append(path_problem("out-dir", run.out_dir, RUN_FILES_RESERVE))
    elif not problems[0]:
        problems.append(path_problem("name", run.name, RUN_FILES_RESERVE, under="runs"))
    if data.root:
        problems.append(path_problem("data.root", data.root))
    return [p for p in problems if p]


def _defense_problems(defense: Component, protocol: str, sections: dict[str, Any]) -> list[str]:
    """What the defense's traits say against this run (nothing is built, no file or data set is loaded): its
    files, the protocols it supports (for one that defends every step, a protocol whose training lets it), and,
    when it declares a ``check_model(model)``, the run's model (built here for that)."""
    if defense.params is None:
        return []  # its parameters were reported already
    traits = defense_traits(defense.name, defense.params)
    problems = _file_problems("defense", defense, traits.files)
    if traits.protocols is not None and protocol not in traits.protocols:
        problems.append(
            f"defense.name = {defense.name!r} works on {' and '.join(sorted(traits.protocols))} "
            f"uploads only; train.protocol = {protocol!r}"
        )
    chosen = run_protocol(protocol) if protocol in PROTOCOLS.names() else None
    if traits.defends_steps and chosen is not None and chosen.upload_kind == "weights" and not chosen.defends_steps:
        problems.append(
            f"defense.name = {defense.name!r} defends every local step of a model upload, and train.protocol = "
            f"{protocol!r} does not follow a defended gradient at each step (its defends_steps is off)"
        )
    if traits.check_model is not None:
        problems += _model_problems(defense.name, traits.check_model, sections["model"], sections["data"])
    return problems


def _model_problems(defense: str, check_model: Callable[[Any], None], model: Component, data: DataSection) -> list[str]:
    """``check_model`` on the run's model, built on the meta device for the data set's static spec (the data are
    not loaded)."""
    spec = dataset_spec(data.name, data.source_options()) if data.name in DATASETS else None
    if spec is None or model.params is None:
        return []  # reported already, or known once the data are loaded (the defense checks the model then)
    try:
        with torch.device("meta"):
            net = build_model(model.name, spec, model.params)
        check_model(net)
    except RuntimeError:
        return []  # a model too large to build: the memory check reports it
    except ValueError as error:
        return [f"defense.{defense} with model.name = {model.name!r}: {error}"]
    return []


def _file_problems(kind: str, component: Component, files: tuple[RequiredFile, ...]) -> list[str]:
    """The files ``component`` loads whose parameter is not set, or names a path that cannot be a file here
    (whether a file is there is not checked: the machine that loads it checks)."""
    problems = []
    for file in files:
        if not file.path:
            problems.append(f"{kind}.{component.name}: {file.unset}")
        elif problem := path_problem(param_key(kind, component.name, file.param), file.path):
            problems.append(problem)
    return problems


def _simulation_problems(attack: str, traits: AttackTraits, defense: Component) -> list[str]:
    """An attack that simulates the clients' defense (EOT) against one that cannot simulate itself."""
    if not traits.simulates_defense or defense.params is None or defense_traits(defense.name, defense.params).simulated:
        return []  # an invalid defense was reported already
    return [
        f"attack.{attack}: EOT needs a defense that can be simulated; defense.name = {defense.name!r} cannot "
        f"(set attack.{attack}.eot = 0)"
    ]


def _attack_problems(
    attack: Component, sections: dict[str, Any], schedule: dict[int, str] | None, captured: CapturedRounds | None
) -> list[str]:
    """Why ``attack`` cannot run in this configuration, from its traits (nothing is built, no file is loaded):
    files, protocol, threat-model grants, the defense it simulates, manipulation (when the schedule and the
    captured rounds are known)."""
    traits = attack_traits(attack.name, attack.params)
    problems = _file_problems("attack", attack, traits.files)
    kind = run_protocol(sections["train"].protocol).upload_kind
    if kind not in traits.uploads:
        problems.append(
            f"attack {attack.name!r} attacks {', '.join(sorted(traits.uploads))} uploads, but "
            f"train.protocol = {sections['train'].protocol!r} uploads {kind}"
        )
    missing = missing_grants(traits, sections["threat"].granted(), kind)
    if missing:
        problems.append(
            f"attack {attack.name!r} needs what the threat model does not grant: {'; '.join(missing)} "
            f"(set the matching threat.* key to true, or choose another attack)"
        )
    problems += _simulation_problems(attack.name, traits, sections["defense"])
    if sections["train"].fedbn and "bn-statistics" in traits.needs | traits.needs_by_upload.get(kind, frozenset()):
        problems.append(
            f"attack {attack.name!r} reads each batch's BatchNorm statistics off the uploaded buffers, which "
            "train.fedbn = true keeps on the clients (the server gets its own back); choose an attack that does "
            "not need them, or train.fedbn = false"
        )
    if sections["threat"].aggregation == "secure" and kind in traits.uploads and kind not in traits.sums:
        able = [name for name in ATTACKS.names() if kind in attack_traits(name).sums]
        problems.append(
            f"attack {attack.name!r} cannot attack a secure aggregate of {kind} uploads (threat.aggregation = "
            f"'secure'); those that can: {', '.join(able)}"
        )
    needed = required_manipulation(traits)
    if schedule is not None and captured is not None and not _captures(captured, schedule, needed):
        where = (
            "a captured round the server does not manipulate"
            if needed == HONEST
            else f"a captured round manipulated with {needed!r} (e.g. threat.malicious = '1:{needed}')"
        )
        problems.append(
            f"attack {attack.name!r} needs {where}; threat.malicious = "
            f"{shown(sections['threat'].malicious)}, capture.rounds = {shown(sections['capture'].rounds)}"
        )
    return problems


def _captures(captured: CapturedRounds, schedule: dict[int, str], needed: str) -> bool:
    """Whether a captured round is manipulated with ``needed`` (``HONEST``: not manipulated); counted, not
    listed."""
    manipulated = [r for r in schedule if r in captured]
    if needed == HONEST:
        return captured.count() > len(manipulated)
    return any(schedule[r] == needed for r in manipulated)
