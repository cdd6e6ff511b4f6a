"""Typed, validated, frozen run configuration: the composition root of its components.

A run is configured by flat keys, as Flower's run config holds them:
``data.name = "mnist-5k"``, ``train.rounds = 20``, ``model.convnet.width = 64``.
The sections' keys, defaults and ranges are the schema's (``fedguard.schema``,
which imports no component registry); this module adds each chosen component's
parameters from its registry, imports plugins, checks everything and builds the
``Config`` (defaults are repeated in ``pyproject.toml`` for ``flwr run``).
Experiment presets are TOML files of the same keys; command line overrides are
``key=value`` strings. Every key, type, range and component
name is checked before anything starts, and all problems are reported at once.

What cannot work is refused here rather than failing in the run: non-finite
floats, integers beyond 64 bits or beyond their use, selections of rounds or
clients the run does not have, parameters whose derived values overflow, paths
the file system cannot hold, presets nested too deeply, and partitions that
leave a client no training data (the limits and their reasons are in
``fedguard.limits``; data set sizes, known without loading, in
``fedguard.data.sizes``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import inspect
import operator
import os
import shlex
import sys
import tomllib
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from attackers import ATTACKS
from attackers.base import AttackTraits, attack_traits, missing_grants, required_manipulation
from attackers.manipulation import HONEST, MANIPULATIONS, ClientManipulation, build_manipulation
from fedguard.data import DATASETS, DatasetNotFoundError, DataSpec
from fedguard.data.partition import PARTITIONERS
from fedguard.data.partition import partition as split_among_clients
from fedguard.data.registry import ROOTED, dataset_spec
from fedguard.data.sizes import samples_needed, split_sizes, train_class_counts
from fedguard.defenses import DEFENSES
from fedguard.defenses.base import defense_traits
from fedguard.defenses.dp_sgd import DPSGDParams
from fedguard.detect import DETECTORS
from fedguard.limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_LISTED,
    RUN_FILES_RESERVE,
    finite_problem,
    name_problem,
    nesting_problem,
    path_problem,
    shown,
)
from fedguard.models import MODELS, build_model
from fedguard.observation import ModelCard
from fedguard.protocols import protocol as run_protocol
from fedguard.registry import NoParams, Registry, RequiredFile, field_help
from fedguard.schema import AUTO_STRATEGY as AUTO_STRATEGY  # the schema's names, read from here too
from fedguard.schema import NO_ATTACK as NO_ATTACK
from fedguard.schema import SECTIONS as SECTIONS
from fedguard.schema import CaptureSection as CaptureSection
from fedguard.schema import Component as Component
from fedguard.schema import ConfigError as ConfigError
from fedguard.schema import DataSection as DataSection
from fedguard.schema import DetectSection as DetectSection
from fedguard.schema import PartitionSection as PartitionSection
from fedguard.schema import PoolSection as PoolSection
from fedguard.schema import RunSection as RunSection
from fedguard.schema import Scalar as Scalar
from fedguard.schema import ServerSection as ServerSection
from fedguard.schema import SimSection as SimSection
from fedguard.schema import ThreatSection as ThreatSection
from fedguard.schema import TrackSection as TrackSection
from fedguard.schema import TrainSection as TrainSection
from fedguard.schema import parse_schedule as parse_schedule
from fedguard.spans import Spans, describe
from fedguard.training import trainable_mask
from strategies.registry import STRATEGIES, strategy_names
from strategies.registry import min_replies as strategy_min_replies
from strategies.registry import protocol_problem as strategy_protocol_problem
from strategies.registry import resolve as resolve_strategy

COMPONENT_KINDS: dict[str, tuple[Registry[Any], str, str]] = {
    "model": (MODELS, "mlp", "model architecture"),
    "defense": (DEFENSES, "none", "client-side defense applied to every upload"),
    "attack": (ATTACKS, NO_ATTACK, "attacks run on captured uploads, comma-separated ('none': capture only)"),
    "detect": (
        DETECTORS,
        NO_ATTACK,
        "checks every client runs on the model it receives, before training, comma-separated ('none': no check)",
    ),
}
# Kinds chosen elsewhere (threat.malicious names the manipulations); only their parameters are keys.
PARAMETER_KINDS: dict[str, Registry[Any]] = {"manipulation": MANIPULATIONS}
LISTED_KINDS = {"attack": "attacks", "detect": "detectors"}  # kind -> the Config field of its chosen components
STRATEGY_PREFIX = "server"  # server.<strategy>.<parameter>
CHOICES_OF: dict[str, Callable[[], list[str]]] = {"strategy": strategy_names}
"""The valid values of a schema field that takes its choices from a registry (``choices_of``), by kind."""


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
    detect: DetectSection = DetectSection()
    detectors: tuple[Component, ...] = ()
    pool: PoolSection = PoolSection()
    sim: SimSection = SimSection()
    server: ServerSection = ServerSection()
    track: TrackSection = TrackSection()
    strategy: Component = Component(AUTO_STRATEGY, NoParams())
    """``server.strategy`` with the parameters of the strategy it stands for."""

    @classmethod
    def from_flat(cls, flat: Mapping[str, Any]) -> Config:
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
        strategy = Component(resolve_strategy(self.strategy.name, self.train.protocol), self.strategy.params)
        flat.update(_param_keys(STRATEGY_PREFIX, STRATEGIES, (strategy,)))
        return flat

    def components(self, kind: str) -> tuple[Component, ...]:
        """The chosen components of ``kind`` ('model', 'defense', 'attack', 'detect', 'manipulation')."""
        if kind in LISTED_KINDS:
            return getattr(self, LISTED_KINDS[kind])
        if kind in PARAMETER_KINDS:
            return getattr(self, f"{kind}s")
        return (getattr(self, kind),)

    def attack_devices(self) -> dict[str, str]:
        """Each chosen attack's ``device`` ('auto', 'cpu', 'cuda') by name, for the attacks that have one."""
        return {a.name: device for a in self.attacks if isinstance(device := getattr(a.params, "device", None), str)}

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
    return [NO_ATTACK, *names] if kind in LISTED_KINDS else names


def _dash(name: str) -> str:
    return name.replace("_", "-")


def _key(prefix: str, field_name: str) -> str:
    return f"{prefix}.{_dash(field_name)}" if prefix else _dash(field_name)


def _field_types(cls: type) -> dict[str, type]:
    return dict(typing.get_type_hints(cls))


def _check_type(key: str, value: Any, expected: type) -> tuple[Any, str | None]:
    """``value`` converted to ``expected`` (int -> float allowed), or an error message."""
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value), None
        except OverflowError:
            return value, f"{key} = {shown(value)}: must be a finite number"
    if isinstance(value, expected) and not (expected is int and isinstance(value, bool)):
        return value, None
    return value, f"{key} = {shown(value)}: expected {expected.__name__}, got {type(value).__name__}"


BOUNDS: dict[str, tuple[Callable[[Any, Any], bool], str]] = {
    "ge": (operator.ge, ">="),
    "gt": (operator.gt, ">"),
    "le": (operator.le, "<="),
    "lt": (operator.lt, "<"),
}


def _bounds(expected: type, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The bounds of a key: those ``meta`` declares and, on a side it leaves open, for an integer the 64-bit
    range of the run configuration (``flwr run`` refuses larger integers)."""
    bounds = {name: meta[name] for name in BOUNDS if name in meta}
    if expected is int and not {"ge", "gt"} & bounds.keys():
        bounds["ge"] = INT64_MIN
    if expected is int and not {"le", "lt"} & bounds.keys():
        bounds["le"] = INT64_MAX
    return bounds


def _check_range(key: str, value: Any, expected: type, meta: Mapping[str, Any]) -> str | None:
    """Why ``value`` (of type ``expected``) is out of the range or choices of ``key``, or None."""
    if expected is float:
        problem = finite_problem(key, value)
        if problem:
            return problem
    bounds = _bounds(expected, meta)
    if not all(BOUNDS[name][0](value, bound) for name, bound in bounds.items()):
        valid = " and ".join(f"{BOUNDS[name][1]} {bound}" for name, bound in bounds.items())
        beyond_int64 = expected is int and not INT64_MIN <= value <= INT64_MAX
        why = " (flwr run carries integers in 64 bits)" if beyond_int64 else ""
        return f"{key} = {shown(value)}: must be {valid}{why}"
    if "choices" in meta or "choices_of" in meta:
        choices = meta["choices"]() if "choices" in meta else CHOICES_OF[meta["choices_of"]]()
        if value not in choices:
            return f"{key} = {shown(value)}: choose one of {', '.join(map(str, choices))}"
    return None


def _section_metadata() -> dict[str, Mapping[str, Any]]:
    """Key -> the field metadata (help, bounds, choices) of every section key."""
    return {
        _key(prefix, f.name): f.metadata for prefix, section in SECTIONS.items() for f in dataclasses.fields(section)
    }


def schema() -> dict[str, tuple[type, Any, str]]:
    """Every valid key -> (type, default, help), component parameters included."""
    keys: dict[str, tuple[type, Any, str]] = {}
    for prefix, section in SECTIONS.items():
        types = _field_types(section)
        for f in dataclasses.fields(section):
            keys[_key(prefix, f.name)] = (types[f.name], f.default, f.metadata.get("help", ""))
    for kind, (_registry, default, help_text) in COMPONENT_KINDS.items():
        keys[f"{kind}.name"] = (str, default, f"{help_text}: {', '.join(_choices(kind))}")
    parameterized = [(k, r) for k, (r, _, _) in COMPONENT_KINDS.items()] + list(PARAMETER_KINDS.items())
    for kind, registry in parameterized + [(STRATEGY_PREFIX, STRATEGIES)]:
        for entry in registry.entries():
            types = _field_types(entry.params)
            for f in dataclasses.fields(entry.params):
                help_line = field_help(entry.params, f.name)
                keys[f"{kind}.{entry.name}.{_dash(f.name)}"] = (types[f.name], f.default, help_line)
    return keys


def import_plugins(flat: Mapping[str, Any]) -> list[str]:
    """Import the modules ``server.plugins`` names (from the working directory too); problems, if any."""
    value = flat.get("server.plugins", "")
    if not isinstance(value, str):
        return []  # reported with the types
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    return [problem for module in split_names(value) if (problem := _import_plugin(module, value))]


def _import_plugin(module: str, value: str) -> str | None:
    """Import ``module``; why it cannot be, or None. A plugin runs its own code on import: whatever it raises
    is reported with the other problems."""
    if not all(part.isidentifier() for part in module.split(".")):
        return (
            f"server.plugins = {shown(value)}: {shown(module)} is not a module name (dotted Python "
            f"identifiers, e.g. extensions.norm_clipped)"
        )
    try:
        importlib.import_module(module)
    except Exception as error:  # a plugin's import error of any kind is a configuration problem
        return f"server.plugins = {shown(value)}: cannot import {shown(module)} ({type(error).__name__}: {error})"
    return None


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
    try:
        items = shlex.split(text) if isinstance(text, str) else []
    except ValueError as error:
        problems.append(f"server.plugin-params = {shown(text)}: cannot split it into key=value items ({error})")
        return {}
    unpacked: dict[str, Any] = {}
    for item in items:
        try:
            key, value = parse_override(item)
        except ConfigError as error:
            problems.extend(f"server.plugin-params: {p}" for p in error.problems)
            continue
        unpacked[key] = value
    return unpacked


def _build(flat: Mapping[str, Any]) -> Config:
    """Validate ``flat`` into a ``Config``; raises one ``ConfigError`` listing every problem."""
    problems = import_plugins(flat)
    flat = {**plugin_params(flat, problems), **flat}
    values, invalid = _checked_values(flat, problems)
    sections: dict[str, Any] = {
        prefix or "run": section(
            **{f.name: values.get(_key(prefix, f.name), f.default) for f in dataclasses.fields(section)}
        )
        for prefix, section in SECTIONS.items()
    }

    for kind, (registry, default, _) in COMPONENT_KINDS.items():
        value = values.get(f"{kind}.name", default)
        names = split_names(value) if kind in LISTED_KINDS else [value]
        names = [] if kind in LISTED_KINDS and names == [NO_ATTACK] else names
        for name in names:
            if name not in _choices(kind) or (kind in LISTED_KINDS and name == NO_ATTACK):
                problems.append(
                    f"{kind}.name = {shown(value)}: {shown(name)} is not one of {', '.join(_choices(kind))}"
                )
        if len(set(names)) < len(names):
            problems.append(f"{kind}.name = {shown(value)}: names a component twice")
        params = _component_params(kind, registry, values, problems)
        chosen = tuple(Component(n, params.get(n)) for n in names if n in params)
        sections[LISTED_KINDS.get(kind, kind)] = (
            chosen if kind in LISTED_KINDS else (chosen[0] if chosen else Component(value, None))
        )
    try:
        scheduled = sorted(set(parse_schedule(sections["threat"].malicious, MANIPULATIONS.names).values()))
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

    problems += _cross_checks(sections, invalid)
    if problems:
        raise ConfigError(problems)
    return Config(**sections)


def _checked_values(flat: Mapping[str, Any], problems: list[str]) -> tuple[dict[str, Any], set[str]]:
    """The values of ``flat`` that pass their key's own checks (known key, type, finite, range, choices),
    converted, and the keys whose values do not (each reported in ``problems``)."""
    keys, metadata = schema(), _section_metadata()
    values: dict[str, Any] = {}
    invalid: set[str] = set()
    for key, value in flat.items():
        if key not in keys:
            problems.append(_unknown_key(key, keys))
            continue
        expected = keys[key][0]
        converted, error = _check_type(key, value, expected)
        error = error or _check_range(key, converted, expected, metadata.get(key, {}))
        if error:
            problems.append(error)
            invalid.add(key)
        else:
            values[key] = converted
    return values, invalid


def _unknown_key(key: str, keys: Mapping[str, Any]) -> str:
    """The problem of an unknown key, with the known keys closest to it."""
    close = difflib.get_close_matches(key, keys, n=3) if len(key) <= 2 * max(map(len, keys)) else []
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return f"unknown key {shown(key)}{hint} (`fedguard config` lists every key)"


PARAM_ERRORS = (ValueError, TypeError, ArithmeticError)


def _component_params(
    kind: str, registry: Registry[Any], values: Mapping[str, Any], problems: list[str]
) -> dict[str, Any]:
    """Name -> parameter dataclass of every registered ``kind`` (invalid ones reported and left out)."""
    built: dict[str, Any] = {}
    for entry in registry.entries():
        given = {
            f.name: values[_param_key(kind, entry.name, f.name)]
            for f in dataclasses.fields(entry.params)
            if _param_key(kind, entry.name, f.name) in values
        }
        try:
            params = entry.params(**given)
        except PARAM_ERRORS as error:
            problems += _attributed(kind, entry, given, error)
            continue
        derived = _derived_problem(kind, entry.name, params, given)
        if derived:
            problems.append(derived)
            continue
        built[entry.name] = params
    return built


def _param_key(kind: str, name: str, field_name: str) -> str:
    return f"{kind}.{name}.{_dash(field_name)}"


def _settings(kind: str, name: str, given: Mapping[str, Any]) -> str:
    """'defense.dp.clip = 0.5, defense.dp.epsilon = 2.0': the keys ``given`` sets."""
    return ", ".join(f"{_param_key(kind, name, field)} = {shown(value)}" for field, value in given.items())


def _attributed(kind: str, entry: Any, given: Mapping[str, Any], error: Exception) -> list[str]:
    """``error`` of ``entry``'s parameters, each problem naming the keys that cause it: every key refused on
    its own, else (a combination is refused) all the keys set."""
    alone = {}
    for name, value in given.items():
        try:
            entry.params(**{name: value})
        except PARAM_ERRORS as own:
            alone[name] = own
    if not alone:
        return [f"{kind}.{entry.name}: {error} ({_settings(kind, entry.name, given)})"]
    return [
        f"{kind}.{entry.name}: {own} ({_settings(kind, entry.name, {field: given[field]})})"
        for field, own in alone.items()
    ]


def _derived_problem(kind: str, name: str, params: Any, given: Mapping[str, Any]) -> str | None:
    """Why a value derived from ``params`` (a property of their class, e.g. the noise scale an epsilon sets)
    cannot be computed, or None; parameters left at their defaults are not probed."""
    if not given:
        return None
    for attribute, _ in inspect.getmembers(type(params), lambda member: isinstance(member, property)):
        try:
            getattr(params, attribute)
        except PARAM_ERRORS as error:
            return (
                f"{kind}.{name}: its {_dash(attribute)} cannot be computed from {_settings(kind, name, given)} "
                f"({type(error).__name__}: {error}); choose values of a usable size"
            )
    return None


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


def _cross_checks(sections: dict[str, Any], invalid: set[str]) -> list[str]:
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
    labels = np.repeat(np.arange(len(counts)), counts)
    try:
        with warnings.catch_warnings():  # the partitioner's notes (e.g. classes no client holds) are the run's
            warnings.simplefilter("ignore")
            shares = split_among_clients(labels, partition.num_clients, partition.name, partition.options(), seed)
    except ValueError as error:
        return None, [
            f"data.name = {data.name!r}, partition.name = {partition.name!r}, partition.num-clients = "
            f"{partition.num_clients}: {error}"
        ]
    return [len(share) for share in shares], []


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
    problems = _batch_problems(net, spec, sections, invalid, sizes)
    problems += _manipulation_problems(net, spec, sections, sizes)
    return problems + _attack_model_problems(net, sections)


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
            defaults = dataclasses.asdict(type(attack.params)())
            changed = {k: v for k, v in dataclasses.asdict(attack.params).items() if v != defaults[k]}
            settings = f" ({_settings('attack', attack.name, changed)})" if changed else ""
            problem = f"attack.{attack.name} with model.name = {sections['model'].name!r}: {error}{settings}"
            problems += _chosen_by("attack", names, [problem])
    return problems


def _batch_problems(
    net: nn.Module, spec: DataSpec, sections: dict[str, Any], invalid: set[str], sizes: list[int] | None
) -> list[str]:
    """A BatchNorm model's training forward pass (on the meta device) at each batch size the clients train on:
    ``train.batch-size`` or a client's smaller share, and under a protocol of several batches the last one of an
    epoch; a BatchNorm layer needs more than one value per channel."""
    train, partition = sections["train"], sections["partition"]
    keys = ("train.batch-size", "train.protocol", "partition.max-per-client")
    if not _usable(invalid, *keys) or not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules()):
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
            settings = _settings("manipulation", manipulation.name, values)
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
    Bulyan skips every round with fewer than 4 f + 3 and leaves the model as it was)."""
    train, strategy = sections["train"], sections["strategy"]
    name = resolve_strategy(sections["server"].strategy, train.protocol)
    if name not in STRATEGIES or strategy.params is None or not _usable(invalid, "train.clients-per-round"):
        return []
    needed = strategy_min_replies(name, strategy.params)
    if train.clients_per_round >= needed:
        return []
    settings = _settings(STRATEGY_PREFIX, name, dataclasses.asdict(strategy.params))
    return [
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
    files, the protocols it supports and, when it declares a ``check_model(model)``, the run's model (built here
    for that)."""
    if defense.params is None:
        return []  # its parameters were reported already
    traits = defense_traits(defense.name, defense.params)
    problems = _file_problems("defense", defense, traits.files)
    if traits.protocols is not None and protocol not in traits.protocols:
        problems.append(
            f"defense.name = {defense.name!r} works on {' and '.join(sorted(traits.protocols))} "
            f"uploads only; train.protocol = {protocol!r}"
        )
    if traits.check_model is not None:
        problems += _model_problems(defense.name, traits.check_model, sections["model"], sections["data"])
    return problems


def _model_problems(defense: str, check_model: Callable[[Any], None], model: Component, data: DataSection) -> list[str]:
    """``check_model`` on the run's model, built for the data set's static spec (the data are not loaded)."""
    spec = dataset_spec(data.name, data.source_options()) if data.name in DATASETS else None
    if spec is None or model.params is None:
        return []  # reported already, or known once the data are loaded (the defense checks the model then)
    try:
        check_model(build_model(model.name, spec, model.params))
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
        elif problem := path_problem(_param_key(kind, component.name, file.param), file.path):
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


def flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested TOML tables -> dotted keys, as Flower flattens its run config (iteratively: any depth)."""
    flat: dict[str, Any] = {}
    stack = [(prefix, iter(table.items()))]
    while stack:
        path, items = stack[-1]
        for key, value in items:
            full = f"{path}.{key}" if path else key
            if isinstance(value, Mapping):
                stack.append((full, iter(value.items())))
                break
            flat[full] = value
        else:
            stack.pop()
    return flat


def parse_override(text: str) -> tuple[str, Scalar]:
    """'key=value' -> (key, typed value), the type taken from the schema."""
    if "=" not in text:
        raise ConfigError([f"override {shown(text)}: write key=value, e.g. train.rounds=5"])
    key, raw = (part.strip() for part in text.split("=", 1))
    keys = schema()
    if key not in keys:
        raise ConfigError([_unknown_key(key, keys)])
    expected = keys[key][0]
    if expected is bool:
        lowered = raw.lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ConfigError([f"{key} = {shown(raw)}: expected true or false"])
        return key, lowered in ("true", "1", "yes")
    if expected in (int, float):
        try:
            return key, expected(raw)
        except ValueError:
            raise ConfigError([f"{key} = {shown(raw)}: expected {expected.__name__}"]) from None
    return key, raw.strip('"')


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML document of the preset at ``path``; raises ``ConfigError`` when it is missing, cannot be read,
    is not TOML or nests tables more than ``MAX_NESTING`` deep."""
    name = f"preset {shown(str(path))}"
    if not os.path.isfile(path):
        raise ConfigError([f"{name} not found (presets live in experiments/)"])
    try:
        document = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ConfigError([f"{name} is not valid TOML: {error}"]) from None
    except RecursionError:
        raise ConfigError([f"{name}: arrays or inline tables are nested too deeply to read"]) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError([f"{name} cannot be read as text: {error}"]) from None
    nested = nesting_problem(document)
    if nested:
        raise ConfigError([f"{name}: {nested}"])
    return document


def read_preset(preset: Path) -> dict[str, Any]:
    """The flat keys of the preset TOML file ``preset``; raises ``ConfigError`` when ``read_toml`` refuses it or
    it describes a sweep."""
    document = read_toml(preset)
    if "sweep" in document:
        raise ConfigError(
            [
                f"preset {shown(str(preset))} describes a sweep of several runs ([sweep] table): run it "
                f"with `fedguard sweep {preset}`"
            ]
        )
    return flatten(document)


def _section_paths() -> dict[str, list[str]]:
    """Section attribute ('run', 'data', ...) -> its fields that name a file or folder (``path=True``)."""
    paths = {
        prefix or "run": [f.name for f in dataclasses.fields(section) if f.metadata.get("path")]
        for prefix, section in SECTIONS.items()
    }
    return {section: names for section, names in paths.items() if names}


def _file_params(kind: str, component: Component) -> tuple[RequiredFile, ...]:
    """The files a chosen defense or attack declares it loads (none for invalid parameters)."""
    if component.params is None:
        return ()
    traits = defense_traits if kind == "defense" else attack_traits
    return traits(component.name, component.params).files


def path_values(config: Config) -> dict[str, str]:
    """Key -> value of every set key that names a file or folder: ``out-dir``, ``data.root`` and each file a
    chosen defense or attack loads (``defense.refiner.evalnet``, ``attack.ggl.generator``, Mjölnir's
    ``denoiser``, a plugin's declared files)."""
    values = {
        _key("" if section == "run" else section, name): getattr(getattr(config, section), name)
        for section, names in _section_paths().items()
        for name in names
    }
    for kind in ("defense", "attack"):
        for component in config.components(kind):
            for file in _file_params(kind, component):
                values[_param_key(kind, component.name, file.param)] = file.path
    return {key: value for key, value in values.items() if value}


def resolve_paths(config: Config, base: Path) -> Config:
    """``config`` with every relative path of ``path_values`` made absolute against the folder ``base`` (``~``
    expanded): a run's processes start in folders of their own, so every path is resolved once, where it was
    typed."""

    def absolute(value: str) -> str:
        return str(Path(base, Path(value).expanduser()).absolute()) if value else value

    sections = {
        section: dataclasses.replace(
            getattr(config, section), **{name: absolute(getattr(getattr(config, section), name)) for name in names}
        )
        for section, names in _section_paths().items()
    }

    def with_files(kind: str, component: Component) -> Component:
        files = {file.param: absolute(file.path) for file in _file_params(kind, component)}
        return (
            dataclasses.replace(component, params=dataclasses.replace(component.params, **files))
            if files
            else component
        )

    return dataclasses.replace(
        config,
        **sections,
        defense=with_files("defense", config.defense),
        attacks=tuple(with_files("attack", a) for a in config.attacks),
    )


def relative_path_problems(config: Config) -> list[str]:
    """The files and data folder of ``config`` given as relative paths (``out-dir`` aside, which has a meaning of
    its own there): under ``flwr run`` the app's processes start in the SuperLink's folder, not where the command
    was typed."""
    return [
        f"{key} = {value!r} is a relative path: under `flwr run` the ServerApp and ClientApps start in the "
        f"SuperLink's folder ({os.getcwd()}), not where you typed it; give an absolute path, or start the run "
        f"with `fedguard run`, which resolves paths against the folder it runs in"
        for key, value in path_values(config).items()
        if key != "out-dir" and not Path(value).is_absolute()
    ]


def load_config(
    preset: Path | str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    base: Path | None = None,
    keys: Mapping[str, Any] | None = None,
) -> Config:
    """Defaults, then the preset TOML file (if any), then ``keys`` (a mapping, flat or nested as in a preset),
    then ``key=value`` overrides; raises one ``ConfigError`` listing the problems of all of them (the keys are
    checked together once the preset could be read).

    Relative paths (``path_values``) are resolved against ``base``, the current folder by default: paths in a
    preset and on the command line alike mean what they mean where the command runs."""
    flat: dict[str, Any] = {}
    preset_problems: list[str] = []
    if preset is not None:
        try:
            flat.update(read_preset(Path(preset)))
        except ConfigError as error:
            preset_problems = error.problems
    flat.update(flatten(keys or {}))
    plugins = [text for text in overrides if text.partition("=")[0].strip() == "server.plugins"]
    if plugins:  # imported first: the overrides may set their keys
        flat.update([parse_override(plugins[-1])])
    import_plugins(flat)
    problems = list(preset_problems)
    for text in overrides:
        try:
            key, value = parse_override(text)
        except ConfigError as error:
            if preset_problems or "=" not in text:
                problems += error.problems
                continue
            key, value = (part.strip() for part in text.split("=", 1))  # the validation reports it, by its key
        flat[key] = value
    if not preset_problems:
        try:
            config = Config.from_flat(flat)
        except ConfigError as error:
            problems += error.problems
        else:
            if not problems:
                return resolve_paths(config, Path.cwd() if base is None else base)
    raise ConfigError(problems)
