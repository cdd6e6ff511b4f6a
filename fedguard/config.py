"""Typed, validated, frozen run configuration.

A run is configured by flat keys, as Flower's run config holds them:
``data.name = "mnist-5k"``, ``train.rounds = 20``, ``model.convnet.width = 64``.
Defaults live in the dataclasses below (and are repeated in ``pyproject.toml``
for ``flwr run``); experiment presets are TOML files of the same keys; command
line overrides are ``key=value`` strings. Every key, type, range and component
name is checked before anything starts, and all problems are reported at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import os
import shlex
import sys
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from attackers import ATTACKS
from attackers.base import AttackTraits, attack_traits, missing_grants, required_manipulation
from attackers.manipulation import HONEST, MANIPULATIONS
from fedguard.data import DATASETS, SourceOptions
from fedguard.data.partition import PARTITIONERS, PartitionOptions
from fedguard.data.registry import dataset_spec
from fedguard.defenses import DEFENSES
from fedguard.defenses.base import defense_traits
from fedguard.models import MODELS, build_model
from fedguard.registry import NoParams, Registry, RequiredFile
from fedguard.selection import Selection
from strategies.registry import AUTO as AUTO_STRATEGY
from strategies.registry import STRATEGIES, strategy_names
from strategies.registry import protocol_problem as strategy_protocol_problem
from strategies.registry import resolve as resolve_strategy

Scalar = bool | int | float | str
NO_ATTACK = "none"


class ConfigError(ValueError):
    """One or more configuration problems, each naming the key, the value and the valid choices."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid configuration:\n  " + "\n  ".join(problems))


def option(default: Scalar, help: str, **checks: Any) -> Any:
    """A config field with its help text and checks (ge, gt, le, lt, choices)."""
    return field(default=default, metadata={"help": help, **checks})


@dataclass(frozen=True)
class RunSection:
    name: str = option("fedguard", "run name; output goes to runs/<name> unless out-dir is set")
    seed: int = option(0, "seed of partitioning, client sampling of batches and model initialization", ge=0)
    out_dir: str = option("", "output folder (empty: runs/<name>)")


@dataclass(frozen=True)
class DataSection:
    name: str = option("mnist-5k", "dataset", choices=DATASETS.names)
    root: str = option("", "local folder for datasets that do not ship with the packages")
    download: bool = option(False, "let torchvision download a missing dataset (needs the network)")
    test_fraction: float = option(0.2, "held-out share for datasets without an official test split", gt=0.0, lt=1.0)
    image_size: int = option(32, "side in pixels for the photos and imagefolder sources", ge=8)

    def source_options(self) -> SourceOptions:
        """The loader's view of this section."""
        return SourceOptions(self.root, self.download, self.test_fraction, self.image_size)


@dataclass(frozen=True)
class PartitionSection:
    name: str = option("iid", "how training data is split among clients", choices=PARTITIONERS.names)
    num_clients: int = option(10, "number of clients (simulated SuperNodes)", ge=1)
    alpha: float = option(0.5, "Dirichlet concentration for partition.name = 'dirichlet'", gt=0.0)
    classes_per_client: int = option(2, "classes each client holds for partition.name = 'classes'", ge=1)

    def options(self) -> PartitionOptions:
        """The partitioner's view of this section."""
        return PartitionOptions(self.alpha, self.classes_per_client)


@dataclass(frozen=True)
class TrainSection:
    protocol: str = option("fedsgd", "fedsgd: one batch gradient per client; fedavg: local epochs, weights uploaded",
                           choices=lambda: ["fedavg", "fedsgd"])
    rounds: int = option(20, "number of federated rounds", ge=1)
    clients_per_round: int = option(10, "clients sampled in each round", ge=1)
    batch_size: int = option(32, "samples per client batch", ge=1)
    lr: float = option(0.5, "learning rate: the server's SGD step (fedsgd) or the clients' local SGD (fedavg)", gt=0.0)
    local_epochs: int = option(1, "local epochs per round (fedavg)", ge=1)


@dataclass(frozen=True)
class CaptureSection:
    rounds: str = option("1", "rounds whose uploads the server captures: 'all', 'none', '1,3,5-7'")
    clients: str = option("all", "client (partition) ids whose uploads are captured: 'all', 'none', '0,2-4'")
    ground_truth: bool = option(True, "clients of targeted rounds write their true batch to the run's vault for "
                                      "scoring (simulation; never shown to the attacker)")

    def round_selection(self) -> Selection:
        return Selection.parse(self.rounds, "capture.rounds")

    def client_selection(self) -> Selection:
        return Selection.parse(self.clients, "capture.clients")


@dataclass(frozen=True)
class ThreatSection:
    labels: bool = option(False, "the server knows the true labels of each batch (otherwise attacks infer them)")
    bn_statistics: bool = option(False, "the server knows the BatchNorm statistics of each batch")
    hyperparameters: bool = option(True, "the server may use the local hyper-parameters clients declare")
    defense: bool = option(False, "the server knows the clients' defense and its parameters, not its randomness "
                                  "(needed by EOT attacks)")
    malicious: str = option("", "rounds in which a malicious server manipulates the model it sends, as "
                                "round:manipulation pairs, e.g. '2:trap-weights, 3:imprint' ('': an honest server)")

    def schedule(self) -> dict[int, str]:
        """Round -> manipulation name; raises ``ValueError`` naming a bad pair."""
        return parse_schedule(self.malicious)

    def granted(self) -> set[str]:
        """The grants, named as attacks name their needs."""
        flags = {"labels": self.labels, "bn-statistics": self.bn_statistics, "hyperparameters": self.hyperparameters,
                 "defense": self.defense}
        return {name for name, granted in flags.items() if granted}


def parse_schedule(text: str) -> dict[int, str]:
    """'2:trap-weights, 3:imprint' -> {2: 'trap-weights', 3: 'imprint'}; '' -> {}."""
    schedule: dict[int, str] = {}
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        round_text, _, name = (part.strip() for part in piece.partition(":"))
        if not round_text.isdigit() or int(round_text) < 1 or not name:
            raise ValueError(f"threat.malicious: {piece!r} is not round:manipulation (e.g. '2:trap-weights')")
        if name not in MANIPULATIONS:
            raise ValueError(f"threat.malicious: manipulation {name!r} in {piece!r}: choose one of "
                             f"{', '.join(MANIPULATIONS.names())}")
        if int(round_text) in schedule:
            raise ValueError(f"threat.malicious: round {round_text} is manipulated twice")
        schedule[int(round_text)] = name
    return schedule


@dataclass(frozen=True)
class PoolSection:
    workers: int = option(1, "attacker worker processes (one GPU each when CUDA is visible)", ge=1)
    time_limit: float = option(900.0, "seconds one captured upload may take before its worker is restarted", gt=0.0)
    wait: float = option(1800.0, "seconds to wait after the last round for attacks still running", ge=0.0)
    group: int = option(4, "most captured uploads of one shape a worker attacks in one batch", ge=1)
    threads: int = option(1, "torch threads of each CPU worker", ge=1)
    address: str = option("", "Ray cluster to join when none is running ('' = the simulation's or a new local one)")


@dataclass(frozen=True)
class ServerSection:
    strategy: str = option(AUTO_STRATEGY, "how the server aggregates: 'auto' (fedsgd for train.protocol = 'fedsgd', "
                                          "fedavg for 'fedavg') or a registered strategy",
                           choices=lambda: strategy_names())
    connect_timeout: float = option(10.0, "seconds the server waits for one SuperNode per client before it stops "
                                          "and says how to fix the federation", gt=0.0)
    plugins: str = option("", "modules imported before the configuration is checked, comma-separated: they "
                              "register strategies, defenses or attacks of your own")
    plugin_params: str = option("", "parameters of plugins as space-separated key=value pairs, e.g. "
                                    "'server.my-strategy.clip=0.5': flwr run passes only the keys pyproject.toml "
                                    "declares, so undeclared keys travel here")


@dataclass(frozen=True)
class SimSection:
    num_cpus: int = option(2, "CPU cores Ray may use", ge=1)
    client_cpus: int = option(1, "CPU cores reserved for each simulated client (whole cores, as Flower's "
                                 "client-resources-num-cpus)", ge=1)
    client_gpus: float = option(0.0, "GPU share reserved for each simulated client", ge=0.0)
    address: str = option("", "Ray cluster to run the simulation on, e.g. 10.0.0.5:6379 ('' = a new local one; "
                              "num-cpus is then the cluster's)")


@dataclass(frozen=True)
class Component:
    """A registered component chosen by name, with its parameter dataclass instance."""

    name: str
    params: Any


COMPONENT_KINDS: dict[str, tuple[Registry[Any], str, str]] = {
    "model": (MODELS, "mlp", "model architecture"),
    "defense": (DEFENSES, "none", "client-side defense applied to every upload"),
    "attack": (ATTACKS, NO_ATTACK, "attacks run on captured uploads, comma-separated ('none': capture only)"),
}
# Kinds chosen elsewhere (threat.malicious names the manipulations); only their parameters are keys.
PARAMETER_KINDS: dict[str, Registry[Any]] = {"manipulation": MANIPULATIONS}
LISTED_KINDS = ("attack",)
SECTIONS: dict[str, type] = {
    "": RunSection,
    "data": DataSection,
    "partition": PartitionSection,
    "train": TrainSection,
    "capture": CaptureSection,
    "threat": ThreatSection,
    "pool": PoolSection,
    "sim": SimSection,
    "server": ServerSection,
}
STRATEGY_PREFIX = "server"  # server.<strategy>.<parameter>


@dataclass(frozen=True)
class Config:
    """A whole, validated run configuration."""

    run: RunSection = RunSection()
    data: DataSection = DataSection()
    partition: PartitionSection = PartitionSection()
    model: Component = Component("mlp", MODELS.get("mlp").params())
    train: TrainSection = TrainSection()
    defense: Component = Component("none", DEFENSES.get("none").params())
    attacks: tuple[Component, ...] = ()
    manipulations: tuple[Component, ...] = ()
    capture: CaptureSection = CaptureSection()
    threat: ThreatSection = ThreatSection()
    pool: PoolSection = PoolSection()
    sim: SimSection = SimSection()
    server: ServerSection = ServerSection()
    strategy: Component = Component(AUTO_STRATEGY, NoParams())
    """``server.strategy`` with the parameters of the strategy it stands for."""

    @classmethod
    def from_flat(cls, flat: Mapping[str, Any]) -> "Config":
        """Validate flat keys (missing ones take defaults) into a ``Config``; raises ``ConfigError``.

        Memoized per process (every client validates the run config every round): identical keys and values
        give the same frozen ``Config``, validated once."""
        key = _memo_key(flat)
        return _build(flat) if key is None else _build_memoized(key)

    def to_flat(self) -> dict[str, Scalar]:
        """Every key with its value, parameters of the components not chosen included."""
        flat: dict[str, Scalar] = {}
        for prefix, section in SECTIONS.items():
            for f in dataclasses.fields(section):
                flat[_key(prefix, f.name)] = getattr(getattr(self, prefix or "run"), f.name)
        for kind, (registry, _, _) in COMPONENT_KINDS.items():
            chosen = self.components(kind)
            flat[f"{kind}.name"] = ",".join(c.name for c in chosen) or NO_ATTACK
            flat.update(_param_keys(kind, registry, chosen))
        for kind, registry in PARAMETER_KINDS.items():
            flat.update(_param_keys(kind, registry, self.components(kind)))
        chosen = Component(resolve_strategy(self.strategy.name, self.train.protocol), self.strategy.params)
        flat.update(_param_keys(STRATEGY_PREFIX, STRATEGIES, (chosen,)))
        return flat

    def components(self, kind: str) -> tuple[Component, ...]:
        """The chosen components of ``kind`` ('model', 'defense', 'attack', 'manipulation')."""
        if kind in LISTED_KINDS or kind in PARAMETER_KINDS:
            return getattr(self, f"{kind}s")
        return (getattr(self, kind),)

    def attack_names(self) -> list[str]:
        """The names of the attacks run on captured uploads (empty: capture only)."""
        return [a.name for a in self.attacks]

    def manipulation(self, name: str) -> Component:
        """The configured manipulation ``name`` (one that ``threat.malicious`` schedules)."""
        for component in self.manipulations:
            if component.name == name:
                return component
        raise ValueError(f"manipulation {name!r} is not scheduled by threat.malicious = {self.threat.malicious!r}")

    def run_dir(self) -> Path:
        """The folder this run writes to."""
        return Path(self.run.out_dir) if self.run.out_dir else Path("runs") / self.run.name


BUILT_IN_PACKAGES = ("fedguard", "attackers", "strategies", "clients")


def _param_keys(kind: str, registry: Registry[Any], chosen: tuple[Component, ...]) -> dict[str, Scalar]:
    """``<kind>.<name>.<param>`` of every built-in entry and of the chosen ones: the chosen ones' values,
    defaults for the rest (a plugin's entry not chosen stays out: another process may not import it)."""
    flat: dict[str, Scalar] = {}
    values = {c.name: c.params for c in chosen}
    for entry in registry.entries():
        if entry.name not in values and entry.factory.__module__.split(".")[0] not in BUILT_IN_PACKAGES:
            continue
        params = values.get(entry.name) or entry.params()
        for f in dataclasses.fields(entry.params):
            flat[f"{kind}.{entry.name}.{_dash(f.name)}"] = getattr(params, f.name)
    return flat


def split_names(value: str) -> list[str]:
    """'ig, dlg' -> ['ig', 'dlg']."""
    return [name.strip() for name in value.split(",") if name.strip()]


def _choices(kind: str) -> list[str]:
    names = COMPONENT_KINDS[kind][0].names()
    return [NO_ATTACK, *names] if kind == "attack" else names


def _dash(name: str) -> str:
    return name.replace("_", "-")


def _key(prefix: str, field_name: str) -> str:
    return f"{prefix}.{_dash(field_name)}" if prefix else _dash(field_name)


def _field_types(cls: type) -> dict[str, type]:
    return {name: hint for name, hint in typing.get_type_hints(cls).items()}


def _check_type(key: str, value: Any, expected: type) -> tuple[Any, str | None]:
    """``value`` converted to ``expected`` (int -> float allowed), or an error message."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value), None
    if isinstance(value, expected) and not (expected is int and isinstance(value, bool)):
        return value, None
    return value, f"{key} = {value!r}: expected {expected.__name__}, got {type(value).__name__}"


def _check_range(key: str, value: Any, meta: Mapping[str, Any]) -> str | None:
    bounds: list[tuple[str, Callable[[Any, Any], bool], str]] = [
        ("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
        ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<"),
    ]
    for name, ok, symbol in bounds:
        if name in meta and not ok(value, meta[name]):
            return f"{key} = {value!r}: must be {symbol} {meta[name]}"
    if "choices" in meta:
        choices = meta["choices"]()
        if value not in choices:
            return f"{key} = {value!r}: choose one of {', '.join(map(str, choices))}"
    return None


def schema() -> dict[str, tuple[type, Any, str]]:
    """Every valid key -> (type, default, help), component parameters included."""
    keys: dict[str, tuple[type, Any, str]] = {}
    for prefix, section in SECTIONS.items():
        types = _field_types(section)
        for f in dataclasses.fields(section):
            keys[_key(prefix, f.name)] = (types[f.name], f.default, f.metadata.get("help", ""))
    for kind, (registry, default, help_text) in COMPONENT_KINDS.items():
        keys[f"{kind}.name"] = (str, default, f"{help_text}: {', '.join(_choices(kind))}")
    parameterized = [(k, r) for k, (r, _, _) in COMPONENT_KINDS.items()] + list(PARAMETER_KINDS.items())
    for kind, registry in parameterized + [(STRATEGY_PREFIX, STRATEGIES)]:
        for entry in registry.entries():
            types = _field_types(entry.params)
            doc = (entry.params.__doc__ or "").strip().split("\n")[0]
            for f in dataclasses.fields(entry.params):
                keys[f"{kind}.{entry.name}.{_dash(f.name)}"] = (types[f.name], f.default, f.metadata.get("help") or doc)
    return keys


def import_plugins(flat: Mapping[str, Any]) -> list[str]:
    """Import the modules ``server.plugins`` names (from the working directory too); problems, if any."""
    value = flat.get("server.plugins", "")
    if not isinstance(value, str):
        return []  # reported with the types
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    problems = []
    for module in split_names(value):
        try:
            importlib.import_module(module)
        except ImportError as error:
            problems.append(f"server.plugins = {value!r}: cannot import {module!r} ({error})")
    return problems


FlatKey = tuple[tuple[str, str, Any], ...]


def _memo_key(flat: Mapping[str, Any]) -> FlatKey | None:
    """``flat`` as sorted (key, type name, value) triples, so that True and 1 differ; None when a value is
    unhashable (a TOML array: a type error ``_build`` reports)."""
    key = tuple(sorted((name, type(value).__name__, value) for name, value in flat.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


@functools.lru_cache(maxsize=64)
def _build_memoized(key: FlatKey) -> Config:
    """``_build`` of the flat keys ``key`` holds; an invalid configuration raises and is not cached."""
    return _build({name: value for name, _, value in key})


def plugin_params(flat: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
    """The keys ``server.plugin-params`` packs ('key=value key=value'), typed by the schema."""
    text = flat.get("server.plugin-params", "")
    unpacked: dict[str, Any] = {}
    for item in shlex.split(text) if isinstance(text, str) else []:
        try:
            key, value = parse_override(item)
        except ConfigError as error:
            problems.extend(f"server.plugin-params: {p}" for p in error.problems)
            continue
        unpacked[key] = value
    return unpacked


def _build(flat: Mapping[str, Any]) -> Config:
    plugin_problems = import_plugins(flat)
    flat = {**plugin_params(flat, plugin_problems), **flat}
    keys = schema()
    problems: list[str] = list(plugin_problems)
    values: dict[str, Any] = {}
    for key, value in flat.items():
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            problems.append(f"unknown key {key!r}{hint} (`fedguard config` lists every key)")
            continue
        converted, error = _check_type(key, value, keys[key][0])
        if error:
            problems.append(error)
        else:
            values[key] = converted

    sections: dict[str, Any] = {}
    for prefix, section in SECTIONS.items():
        kwargs = {}
        for f in dataclasses.fields(section):
            key = _key(prefix, f.name)
            value = values.get(key, f.default)
            error = _check_range(key, value, f.metadata)
            if error:
                problems.append(error)
            kwargs[f.name] = value
        sections[prefix or "run"] = section(**kwargs)

    for kind, (registry, default, _) in COMPONENT_KINDS.items():
        value = values.get(f"{kind}.name", default)
        names = split_names(value) if kind in LISTED_KINDS else [value]
        names = [] if kind in LISTED_KINDS and names == [NO_ATTACK] else names
        for name in names:
            if name not in _choices(kind) or (kind in LISTED_KINDS and name == NO_ATTACK):
                problems.append(f"{kind}.name = {value!r}: {name!r} is not one of {', '.join(_choices(kind))}")
        if len(set(names)) < len(names):
            problems.append(f"{kind}.name = {value!r}: names a component twice")
        params = _component_params(kind, registry, values, problems)
        chosen = tuple(Component(n, params.get(n)) for n in names if n in params)
        sections[f"{kind}s" if kind in LISTED_KINDS else kind] = chosen if kind in LISTED_KINDS else (
            chosen[0] if chosen else Component(value, None))
    try:
        scheduled = sorted(set(sections["threat"].schedule().values()))
    except ValueError as error:
        problems.append(str(error))
        scheduled = []
    for kind, registry in PARAMETER_KINDS.items():
        params = _component_params(kind, registry, values, problems)
        sections[f"{kind}s"] = tuple(Component(n, params.get(n)) for n in scheduled)

    strategies = _component_params(STRATEGY_PREFIX, STRATEGIES, values, problems)
    name = resolve_strategy(sections["server"].strategy, sections["train"].protocol)
    sections["strategy"] = Component(sections["server"].strategy, strategies.get(name))
    problem = strategy_protocol_problem(sections["server"].strategy, sections["train"].protocol)
    if problem:
        problems.append(problem)

    problems += _cross_checks(sections)
    if problems:
        raise ConfigError(problems)
    return Config(**sections)


def _component_params(kind: str, registry: Registry[Any], values: Mapping[str, Any],
                      problems: list[str]) -> dict[str, Any]:
    """Name -> parameter dataclass of every registered ``kind`` (invalid ones reported and left out)."""
    built: dict[str, Any] = {}
    for entry in registry.entries():
        kwargs = {
            f.name: values[f"{kind}.{entry.name}.{_dash(f.name)}"]
            for f in dataclasses.fields(entry.params)
            if f"{kind}.{entry.name}.{_dash(f.name)}" in values
        }
        try:
            built[entry.name] = entry.params(**kwargs)
        except (ValueError, TypeError) as error:
            problems.append(f"{kind}.{entry.name}: {error}")
    return built


def _cross_checks(sections: dict[str, Any]) -> list[str]:
    problems = []
    train, partition, capture = sections["train"], sections["partition"], sections["capture"]
    if train.clients_per_round > partition.num_clients:
        problems.append(
            f"train.clients-per-round = {train.clients_per_round}: must be <= partition.num-clients "
            f"({partition.num_clients})"
        )
    selections = []
    for parse in (capture.round_selection, capture.client_selection):
        try:
            selections.append(parse())
        except ValueError as error:
            problems.append(str(error))
    try:
        schedule = sections["threat"].schedule()
    except ValueError:
        return problems  # reported with the components
    captured = set(range(1, train.rounds + 1))
    if len(selections) == 2:
        captured = {r for r in captured if r in selections[0]}
        for round_ in sorted(schedule):
            if round_ not in captured:
                problems.append(f"threat.malicious manipulates round {round_}, which is not a captured round of "
                                f"this run (capture.rounds = {capture.rounds!r}, train.rounds = {train.rounds})")
    problems += _defense_problems(sections["defense"], train.protocol, sections)
    for attack in sections["attacks"]:
        problems += _attack_problems(attack, sections, schedule, captured)
    return problems


def _defense_problems(defense: Component, protocol: str, sections: dict[str, Any]) -> list[str]:
    """What the defense's traits say against this run (nothing is built, no file or data set is loaded): an
    unset file parameter, the protocols it supports and, when it declares a ``check_model(model)``, the run's
    model (built here for that)."""
    if defense.params is None:
        return []  # its parameters were reported already
    traits = defense_traits(defense.name, defense.params)
    problems = _unset_files("defense", defense, traits.files)
    if traits.protocols is not None and protocol not in traits.protocols:
        problems.append(f"defense.name = {defense.name!r} works on {' and '.join(sorted(traits.protocols))} "
                        f"uploads only; train.protocol = {protocol!r}")
    if traits.check_model is not None:
        problems += _model_problems(defense.name, traits.check_model, sections["model"], sections["data"])
    return problems


def _model_problems(defense: str, check_model: Callable[[Any], None], model: Component,
                    data: DataSection) -> list[str]:
    """``check_model`` on the run's model, built for the data set's static spec (the data are not loaded)."""
    spec = dataset_spec(data.name, data.source_options()) if data.name in DATASETS else None
    if spec is None or model.params is None:
        return []  # reported already, or known once the data are loaded (the defense checks the model then)
    try:
        check_model(build_model(model.name, spec, model.params))
    except ValueError as error:
        return [f"defense.{defense} with model.name = {model.name!r}: {error}"]
    return []


def _unset_files(kind: str, component: Component, files: tuple[RequiredFile, ...]) -> list[str]:
    """The files ``component`` loads whose parameter is not set (whether a set path exists is not checked here:
    the machine that loads the file checks it)."""
    return [f"{kind}.{component.name}: {file.unset}" for file in files if not file.path]


def _simulation_problems(attack: str, traits: AttackTraits, defense: Component) -> list[str]:
    """An attack that simulates the clients' defense (EOT) against one that cannot simulate itself."""
    if not traits.simulates_defense or defense.params is None or defense_traits(defense.name, defense.params).simulated:
        return []  # an invalid defense was reported already
    return [f"attack.{attack}: EOT needs a defense that can be simulated; defense.name = {defense.name!r} cannot "
            f"(set attack.{attack}.eot = 0)"]


def _attack_problems(attack: Component, sections: dict[str, Any], schedule: dict[int, str],
                     captured: set[int]) -> list[str]:
    """Why ``attack`` cannot run in this configuration, from its traits (nothing is built, no file is loaded):
    unset files, protocol, threat-model grants, the defense it simulates, manipulation."""
    traits = attack_traits(attack.name, attack.params)
    problems = _unset_files("attack", attack, traits.files)
    kind = "gradient" if sections["train"].protocol == "fedsgd" else "weights"
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
    needed = required_manipulation(traits)
    rounds = [r for r in captured if schedule.get(r, HONEST) == needed]
    if not rounds:
        where = ("a captured round the server does not manipulate" if needed == HONEST
                 else f"a captured round manipulated with {needed!r} (e.g. threat.malicious = '1:{needed}')")
        problems.append(f"attack {attack.name!r} needs {where}; threat.malicious = "
                        f"{sections['threat'].malicious!r}, capture.rounds = {sections['capture'].rounds!r}")
    return problems


def flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested TOML tables -> dotted keys, as Flower flattens its run config."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        full = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping):
            flat.update(flatten(value, full))
        else:
            flat[full] = value
    return flat


def parse_override(text: str) -> tuple[str, Scalar]:
    """'key=value' -> (key, typed value), the type taken from the schema."""
    if "=" not in text:
        raise ConfigError([f"override {text!r}: write key=value, e.g. train.rounds=5"])
    key, raw = (part.strip() for part in text.split("=", 1))
    keys = schema()
    if key not in keys:
        close = difflib.get_close_matches(key, keys, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError([f"unknown key {key!r}{hint} (`fedguard config` lists every key)"])
    expected = keys[key][0]
    if expected is bool:
        lowered = raw.lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ConfigError([f"{key} = {raw!r}: expected true or false"])
        return key, lowered in ("true", "1", "yes")
    if expected in (int, float):
        try:
            return key, expected(raw)
        except ValueError:
            raise ConfigError([f"{key} = {raw!r}: expected {expected.__name__}"]) from None
    return key, raw.strip('"')


def load_config(preset: Path | str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the preset TOML file (if any), then ``key=value`` overrides."""
    flat: dict[str, Any] = {}
    if preset is not None:
        path = Path(preset)
        if not path.is_file():
            raise ConfigError([f"preset {str(path)!r} not found (presets live in experiments/)"])
        try:
            document = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as error:
            raise ConfigError([f"preset {str(path)!r} is not valid TOML: {error}"]) from None
        if "sweep" in document:
            raise ConfigError([f"preset {str(path)!r} describes a sweep of several runs ([sweep] table): run it with "
                               f"`fedguard sweep {path}`"])
        flat.update(flatten(document))
    plugins = [text for text in overrides if text.partition("=")[0].strip() == "server.plugins"]
    if plugins:  # imported first: the overrides may set their keys
        flat.update([parse_override(plugins[-1])])
    import_plugins(flat)
    for text in overrides:
        key, value = parse_override(text)
        flat[key] = value
    return Config.from_flat(flat)
