"""The source tree is layered: every import between the project's units (a module or package directly under
``fedguard/``, and each of ``attackers/``, ``strategies/``, ``clients/``) goes to a unit of a lower layer, never to
one of its own layer or above. Read statically from every ``import`` in the source, those inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedguard", "attackers", "strategies", "clients")

# Lowest first. A unit may import the units of the layers before its own.
LAYERS: list[set[str]] = [
    {
        "fedguard.limits",
        "fedguard.run_plan",
        "fedguard.atomic",
        "fedguard.run_owner",
        "fedguard.selection",
        "fedguard.seeding",
        "fedguard.app_code",
        "fedguard.plugin_faults",
        "fedguard.training",
        "fedguard.memory",
        "fedguard.wire",
        "fedguard.metrics",
    },
    {"fedguard.aggregate", "fedguard.spans", "fedguard.registry"},
    {"fedguard.data", "fedguard.detect"},
    {"fedguard.trained", "fedguard.observation"},
    {"fedguard.models", "fedguard.protocols"},
    {"fedguard.defenses"},
    {"attackers"},
    {"strategies"},
    {"fedguard.schema"},
    {"fedguard.config_checks"},
    {"fedguard.config"},
    {"fedguard.store"},
    {"clients", "fedguard.report"},
    {"fedguard.tracking", "fedguard.evaluation"},
    {"fedguard.runtime", "fedguard.absent_plugins"},
    {"fedguard.flower"},
    {"fedguard.commands"},
    {"fedguard.api"},
    {"fedguard.__main__", "fedguard"},
]


def unit(parts: tuple[str, ...] | list[str]) -> str:
    """The unit of a module path: ``fedguard.<module or package>``, or the top-level package (``fedguard`` itself
    for its ``__init__``)."""
    if parts[0] == "fedguard" and len(parts) > 1 and parts[1] != "__init__":
        return ".".join(parts[:2])
    return parts[0]


def imports() -> set[tuple[str, str, str]]:
    """(importing unit, imported unit, file) for every import from one of the project's units to another."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            source = unit(path.relative_to(ROOT).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module == "fedguard":  # from fedguard import limits
                    names = [f"fedguard.{alias.name}" for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                elif isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                else:
                    continue
                for name in names:
                    target = unit(name.split("."))
                    if target.split(".")[0] in PACKAGES and target != source:
                        found.add((source, target, str(path.relative_to(ROOT))))
    return found


def layer_of(name: str) -> int:
    [index] = [i for i, layer in enumerate(LAYERS) if name in layer]
    return index


def test_every_unit_of_the_tree_has_a_layer() -> None:
    units = {unit(path.relative_to(ROOT).with_suffix("").parts) for p in PACKAGES for path in (ROOT / p).rglob("*.py")}
    listed = set().union(*LAYERS)
    assert not units - listed, f"units without a layer (add each to LAYERS): {sorted(units - listed)}"
    assert all(sum(name in layer for layer in LAYERS) == 1 for name in listed), "a unit is in two layers"


def test_no_import_runs_up_or_across_the_layers() -> None:
    against = sorted(
        f"{file}: {source} (layer {layer_of(source)}) imports {target} (layer {layer_of(target)})"
        for source, target, file in imports()
        if layer_of(target) >= layer_of(source)
    )
    assert not against, "imports against the layers:\n" + "\n".join(against)


def test_the_floors_import_nothing_of_the_project_above_them() -> None:
    # The four imports that once ran up: the attacker pool to the runtime, the observation to the run folder, the
    # registry to the trained files, the run folder's resume to the clients.
    edges = {(source, target) for source, target, _ in imports()}
    assert ("attackers", "fedguard.runtime") not in edges
    assert ("fedguard.observation", "fedguard.store") not in edges
    assert ("fedguard.registry", "fedguard.trained") not in edges
    assert ("fedguard.store", "clients") not in edges
