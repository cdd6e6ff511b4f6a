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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedguard.app_code import ship_plugin
from fedguard.defenses import DEFENSES
from fedguard.defenses.base import defense_traits
from fedguard.detect import DETECTORS
from fedguard.limits import (
    INT64_MAX,
    INT64_MIN,
    PLUGIN_IMPORT_SECONDS,
    finite_problem,
    nesting_problem,
    shown,
)
from fedguard.models import MODELS
from fedguard.plugin_faults import PluginImportHangs, import_deadline
from fedguard.registry import NoParams, Registry, RequiredFile, field_help
from fedguard.run_plan import PLAN_KEY, plan_keys, plan_text
from fedguard.schema import AUTO_STRATEGY as AUTO_STRATEGY  # the schema's names, read from here too
from fedguard.schema import NO_ATTACK as NO_ATTACK
from fedguard.schema import SECTIONS as SECTIONS
from fedguard.schema import STRATEGY_PREFIX, param_key, settings_text
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
from strategies.registry import STRATEGIES, strategy_names
from strategies.registry import protocol_problem as strategy_protocol_problem
from strategies.registry import resolve as resolve_strategy

KINDS: dict[str, tuple[str, str]] = {  # kind -> (its default name, what it is)
    "model": ("mlp", "model architecture"),
    "defense": ("none", "client-side defense applied to every upload"),
    "attack": (NO_ATTACK, "attacks run on captured uploads, comma-separated ('none': capture only)"),
    "detect": (
        NO_ATTACK,
        "checks every client runs on the model it receives, before training, comma-separated ('none': no check)",
    ),
}
# Kinds chosen elsewhere (threat.malicious names the manipulations); only their parameters are keys.
PARAMETER_KINDS = ("manipulation",)
ATTACK_SIDE = ("attack", "manipulation")  # the kinds only the server's attacks use


def registry(kind: str) -> Registry[Any]:
    """The registry of ``kind`` (one of ``KINDS`` or ``PARAMETER_KINDS``). The attack side's registries are
    imported on first use, with every attack they register: a process that rebuilds a plan without them (a
    client, ``Config.from_plan``) loads no attack code."""
    if kind == "attack":
        from attackers import ATTACKS

        return ATTACKS
    if kind == "manipulation":
        from attackers.manipulation import MANIPULATIONS

        return MANIPULATIONS
    client_side: dict[str, Registry[Any]] = {"model": MODELS, "defense": DEFENSES, "detect": DETECTORS}
    return client_side[kind]


def component_kinds() -> dict[str, tuple[Registry[Any], str, str]]:
    """Kind -> (its registry, its default name, what it is), for every kind a ``<kind>.name`` key chooses."""
    return {kind: (registry(kind), default, help_text) for kind, (default, help_text) in KINDS.items()}


LISTED_KINDS = {"attack": "attacks", "detect": "detectors"}  # kind -> the Config field of its chosen components
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

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any], attack_side: bool = True) -> Config:
        """The configuration of Flower's run config: rebuilt from its run plan (``PLAN_KEY``) where ``fedguard
        run`` wrote one, else validated from its keys (``flwr run``)."""
        text = run_config.get(PLAN_KEY, "")
        if isinstance(text, str) and text:
            return cls.from_plan(text, attack_side)
        return cls.from_flat({key: value for key, value in run_config.items() if key != PLAN_KEY})

    @classmethod
    def from_plan(cls, text: str, attack_side: bool = True) -> Config:
        """The configuration the run plan ``text`` (``plan``) holds, rebuilt without validating it again;
        without ``attack_side`` its attacks and manipulations are left out (a client, which runs none, then
        imports no attack code). ``ConfigError`` for a plan that is not one, or whose plugins cannot be imported
        here. Memoized per process."""
        return _rebuilt(text, attack_side)

    def plan(self) -> str:
        """This configuration as a run plan (``fedguard.run_plan``): the sections' keys, each kind's names and
        the parameters of the chosen components and of the strategy."""
        return plan_text(self.chosen_flat())

    def chosen_flat(self) -> dict[str, Scalar]:
        """``to_flat`` without the parameters of the components not chosen: all that rebuilds this
        configuration."""
        chosen = {f"{kind}.{c.name}." for kind in [*KINDS, *PARAMETER_KINDS] for c in self.components(kind)}
        chosen.add(f"{STRATEGY_PREFIX}.{resolve_strategy(self.strategy.name, self.train.protocol)}.")
        sections = {_key(prefix, f.name) for prefix, section in SECTIONS.items() for f in dataclasses.fields(section)}
        names = {f"{kind}.name" for kind in KINDS}
        return {
            key: value
            for key, value in self.to_flat().items()
            if key in sections or key in names or key.startswith(tuple(chosen))
        }

    def to_flat(self) -> dict[str, Scalar]:
        """Every key with its value, parameters of the components not chosen included."""
        flat: dict[str, Scalar] = {}
        for prefix, section in SECTIONS.items():
            for f in dataclasses.fields(section):
                flat[_key(prefix, f.name)] = getattr(getattr(self, prefix or "run"), f.name)
        for kind in KINDS:
            chosen = self.components(kind)
            flat[f"{kind}.name"] = ",".join(c.name for c in chosen) or NO_ATTACK
            flat.update(_param_keys(kind, registry(kind), chosen))
        for kind in PARAMETER_KINDS:
            flat.update(_param_keys(kind, registry(kind), self.components(kind)))
        strategy = Component(resolve_strategy(self.strategy.name, self.train.protocol), self.strategy.params)
        flat.update(_param_keys(STRATEGY_PREFIX, STRATEGIES, (strategy,)))
        return flat

    def used_flat(self) -> dict[str, Scalar]:
        """The keys that shape this run: the sections' keys (``pool.*`` only when an attack runs,
        ``detect.action`` only when a detector runs), each kind's ``name`` and the parameters of the chosen
        components and of the strategy the run aggregates with, not those of every registered one."""
        idle = {"pool"} if not self.attacks else set()
        skipped = {"detect.action"} if not self.detectors else set()
        sections = {_key(prefix, f.name) for prefix, section in SECTIONS.items() for f in dataclasses.fields(section)}
        return {
            key: value
            for key, value in self.chosen_flat().items()
            if key not in skipped and not (key in sections and key.split(".")[0] in idle)
        }

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


def _param_keys(kind: str, entries: Registry[Any], chosen: tuple[Component, ...]) -> dict[str, Scalar]:
    """``<kind>.<name>.<param>`` of every built-in entry and of the chosen ones: the chosen ones' values,
    defaults for the rest (a plugin's entry not chosen stays out: another process may not import it)."""
    flat: dict[str, Scalar] = {}
    values = {c.name: c.params for c in chosen}
    for entry in entries.entries():
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
    names = registry(kind).names()
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
    for kind, (default, help_text) in KINDS.items():
        keys[f"{kind}.name"] = (str, default, f"{help_text}: {', '.join(_choices(kind))}")
    parameterized = [(kind, registry(kind)) for kind in [*KINDS, *PARAMETER_KINDS]]
    for kind, entries in parameterized + [(STRATEGY_PREFIX, STRATEGIES)]:
        for entry in entries.entries():
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
        with import_deadline(module, PLUGIN_IMPORT_SECONDS):
            imported = importlib.import_module(module)
        ship_plugin(module, getattr(imported, "__file__", None))
    except PluginImportHangs as hangs:
        return f"server.plugins = {shown(value)}: {hangs}; a plugin registers components and must not block"
    except Exception as error:  # a plugin's import error of any kind is a configuration problem
        return f"server.plugins = {shown(value)}: cannot import {shown(module)} ({type(error).__name__}: {error})"
    except SystemExit as exiting:  # sys.exit() on import would end fedguard with the plugin's code, 0 included
        return (
            f"server.plugins = {shown(value)}: importing {shown(module)} called sys.exit({exiting.code!r}); a "
            f"plugin registers components and must not exit"
        )
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


@functools.lru_cache(maxsize=16)
def _rebuilt(text: str, attack_side: bool) -> Config:
    """The configuration of the run plan ``text``, built from its keys as they stand (``Config.from_plan``)."""
    try:
        keys = plan_keys(text)
    except ValueError as error:
        raise ConfigError([str(error)]) from None
    problems = import_plugins(keys)  # a plan's plugins register its components here too
    if problems:
        raise ConfigError(problems)
    sections: dict[str, Any] = {
        prefix or "run": section(
            **{f.name: keys.get(_key(prefix, f.name), f.default) for f in dataclasses.fields(section)}
        )
        for prefix, section in SECTIONS.items()
    }
    for kind, (default, _) in KINDS.items():
        names = split_names(str(keys.get(f"{kind}.name", default)))
        names = [] if kind in LISTED_KINDS and names == [NO_ATTACK] else names
        if kind in ATTACK_SIDE and not attack_side:
            names = []
        chosen = tuple(Component(name, _planned_params(kind, registry(kind), name, keys)) for name in names)
        sections[LISTED_KINDS.get(kind, kind)] = chosen if kind in LISTED_KINDS else chosen[0]
    for kind in PARAMETER_KINDS:
        scheduled = (
            sorted(set(parse_schedule(sections["threat"].malicious, registry(kind).names).values()))
            if attack_side
            else []
        )
        sections[f"{kind}s"] = tuple(
            Component(name, _planned_params(kind, registry(kind), name, keys)) for name in scheduled
        )
    name = resolve_strategy(sections["server"].strategy, sections["train"].protocol)
    sections["strategy"] = Component(
        sections["server"].strategy, _planned_params(STRATEGY_PREFIX, STRATEGIES, name, keys)
    )
    return Config(**sections)


def _planned_params(kind: str, entries: Registry[Any], name: str, keys: Mapping[str, Any]) -> Any:
    """The parameter dataclass of ``kind`` ``name`` from a plan's ``keys`` (defaults for keys it leaves out)."""
    params = entries.get(name).params
    return params(
        **{f.name: keys[key] for f in dataclasses.fields(params) if (key := param_key(kind, name, f.name)) in keys}
    )


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

    from fedguard.config_checks import cross_checks  # the checks of every kind, attacks included

    for kind, (default, _) in KINDS.items():
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
        params = _component_params(kind, registry(kind), values, problems)
        chosen = tuple(Component(n, params.get(n)) for n in names if n in params)
        sections[LISTED_KINDS.get(kind, kind)] = (
            chosen if kind in LISTED_KINDS else (chosen[0] if chosen else Component(value, None))
        )
    try:
        scheduled = sorted(set(parse_schedule(sections["threat"].malicious, registry("manipulation").names).values()))
    except ValueError as error:
        problems.append(str(error))
        scheduled = []
    for kind in PARAMETER_KINDS:
        params = _component_params(kind, registry(kind), values, problems)
        sections[f"{kind}s"] = tuple(Component(n, params.get(n)) for n in scheduled)

    strategies = _component_params(STRATEGY_PREFIX, STRATEGIES, values, problems)
    name = resolve_strategy(sections["server"].strategy, sections["train"].protocol)
    sections["strategy"] = Component(sections["server"].strategy, strategies.get(name))
    problem = strategy_protocol_problem(sections["server"].strategy, sections["train"].protocol)
    if problem:
        problems.append(problem)

    problems += cross_checks(sections, invalid)
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
    kind: str, entries: Registry[Any], values: Mapping[str, Any], problems: list[str]
) -> dict[str, Any]:
    """Name -> parameter dataclass of every registered ``kind`` (invalid ones reported and left out)."""
    built: dict[str, Any] = {}
    for entry in entries.entries():
        given = {
            f.name: values[param_key(kind, entry.name, f.name)]
            for f in dataclasses.fields(entry.params)
            if param_key(kind, entry.name, f.name) in values
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
        return [f"{kind}.{entry.name}: {error} ({settings_text(kind, entry.name, given)})"]
    return [
        f"{kind}.{entry.name}: {own} ({settings_text(kind, entry.name, {field: given[field]})})"
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
                f"{kind}.{name}: its {_dash(attribute)} cannot be computed from {settings_text(kind, name, given)} "
                f"({type(error).__name__}: {error}); choose values of a usable size"
            )
    return None


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
    if kind == "defense":
        return defense_traits(component.name, component.params).files
    from attackers.base import attack_traits  # only for an attack, which the attack side alone holds

    return attack_traits(component.name, component.params).files


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
                values[param_key(kind, component.name, file.param)] = file.path
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
