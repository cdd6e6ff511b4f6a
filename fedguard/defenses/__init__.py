"""Client-side defenses by name. Importing this package registers them all."""

from fedguard.defenses import dp_update, none  # noqa: F401  (registration)
from fedguard.defenses.base import (
    DEFENSES,
    Defense,
    LocalStep,
    aggregate_reports,
    build_defense,
    defense_report,
    register_defense,
)

__all__ = [
    "DEFENSES",
    "Defense",
    "LocalStep",
    "aggregate_reports",
    "build_defense",
    "defense_report",
    "register_defense",
]
