"""Client-side defenses by name. Importing this package registers them all."""

from fedguard.defenses import (  # noqa: F401  (registration)
    censor,
    dgp,
    dp_sgd,
    dp_update,
    none,
    pruning,
    quantization,
    refiner,
    soteria,
)
from fedguard.defenses.base import (
    DEFENSES,
    Defense,
    LocalStep,
    RoundReports,
    aggregate_reports,
    build_defense,
    defense_report,
    register_defense,
)

__all__ = [
    "DEFENSES",
    "Defense",
    "LocalStep",
    "RoundReports",
    "aggregate_reports",
    "build_defense",
    "defense_report",
    "register_defense",
]
