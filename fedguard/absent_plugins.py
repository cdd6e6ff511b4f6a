"""A finished run's recorded configuration made loadable where the plugins it used cannot be imported, for
``fedguard attack``: the attacks need the run's data, model, protocol and attack settings, not the plugin
defenses, strategies, detectors or manipulations that shaped the uploads.

Each component a plugin registered is dropped with its parameters and said so: a defense becomes 'none' (the
attacks, adaptive ones included, attack the uploads as undefended), a strategy the protocol's own, an attack or
a detector leaves its list, a manipulation leaves ``threat.malicious`` (the uploads captured under it are then
skipped as not of this run). A model or protocol from a plugin cannot be replaced: the uploads are its gradients.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attackers.manipulation import MANIPULATIONS
from fedguard.config import (
    LISTED_KINDS,
    NO_ATTACK,
    ConfigError,
    component_kinds,
    import_plugins,
    split_names,
)
from fedguard.protocols import PROTOCOLS
from fedguard.schema import STRATEGY_PREFIX
from strategies.registry import AUTO as AUTO_STRATEGY
from strategies.registry import STRATEGIES

PLUGIN_KEYS = ("server.plugins", "server.plugin-params")
IRREPLACEABLE = ("model",)  # kinds whose plugin component the attacks cannot do without


def without_absent_plugins(flat: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(``flat`` with the components of plugins that cannot be imported here dropped, a note per component
    dropped); ``flat`` unchanged and no notes when ``server.plugins`` imports. Raises ``ConfigError`` when the
    model or the protocol came from such a plugin."""
    if not import_plugins(flat):
        return dict(flat), []
    kept = {key: value for key, value in flat.items() if key not in PLUGIN_KEYS}
    plugins = flat.get("server.plugins", "")
    notes: list[str] = []
    protocol = kept.get("train.protocol", "fedsgd")
    if protocol not in PROTOCOLS:
        raise ConfigError(
            [
                f"train.protocol = {protocol!r} comes from server.plugins = {plugins!r}, which cannot be "
                f"imported here; the uploads are its updates: attack them where it imports"
            ]
        )
    for kind, (registry, default, _) in component_kinds().items():
        chosen = split_names(str(kept.get(f"{kind}.name", default)))
        absent = [name for name in chosen if name != NO_ATTACK and name not in registry]
        if not absent:
            continue
        if kind in IRREPLACEABLE:
            raise ConfigError(
                [
                    f"{kind}.name = {absent[0]!r} comes from server.plugins = {plugins!r}, which cannot "
                    f"be imported here; the attacks rebuild the model: run them where it imports"
                ]
            )
        left = [name for name in chosen if name not in absent]
        kept[f"{kind}.name"] = ", ".join(left) if kind in LISTED_KINDS and left else default
        kept = _dropped(kept, kind, absent)
        notes += [f"{kind} {name!r} ({_consequence(kind)})" for name in absent]
    strategy = str(kept.get("server.strategy", AUTO_STRATEGY))
    if strategy != AUTO_STRATEGY and strategy not in STRATEGIES:
        kept["server.strategy"] = AUTO_STRATEGY
        kept = _dropped(kept, STRATEGY_PREFIX, [strategy])
        notes.append(f"strategy {strategy!r} (the protocol's own strategy stands in; the uploads are as captured)")
    pieces = [piece.strip() for piece in str(kept.get("threat.malicious", "")).split(",") if piece.strip()]
    scheduled = [(piece, piece.partition(":")[2].strip()) for piece in pieces]
    absent_manipulations = sorted({name for _, name in scheduled if name and name not in MANIPULATIONS})
    if absent_manipulations:
        kept["threat.malicious"] = ", ".join(piece for piece, name in scheduled if name not in absent_manipulations)
        kept = _dropped(kept, "manipulation", absent_manipulations)
        notes += [f"manipulation {name!r} (its uploads are skipped)" for name in absent_manipulations]
    return kept, [f"server.plugins = {plugins!r} cannot be imported here; left out: {note}" for note in notes]


def _dropped(flat: dict[str, Any], prefix: str, names: list[str]) -> dict[str, Any]:
    """``flat`` without the parameter keys ``<prefix>.<name>.*`` of each of ``names``."""
    starts = tuple(f"{prefix}.{name}." for name in names)
    return {key: value for key, value in flat.items() if not key.startswith(starts)}


def _consequence(kind: str) -> str:
    """What leaving out a component of ``kind`` means for the attacks."""
    return {
        "defense": "the attacks treat the uploads as undefended; an adaptive one cannot simulate it",
        "attack": "it does not run",
        "detect": "the clients' checks do not matter to the attacks",
    }.get(kind, "not needed by the attacks")
