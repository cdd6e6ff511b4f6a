"""The server-side attacker: attacks on captured observations and the sinks that receive them.

Importing this package registers every attack. Nothing here imports Flower;
Ray is imported only by ``attackers.pool``.
"""

from attackers import (  # noqa: F401  (registration)
    adaptive,
    dlg,
    fc_span,
    fc_span_adaptive,
    feature_fishing,
    fedavg_inversion,
    fishing,
    generative,
    gradinversion,
    imprint,
    imprint_hidden,
    inverting_gradients,
    mjolnir,
    trap_weights,
)
from attackers.base import ATTACKS, Attack, Reconstruction, build_attack, register_attack
from attackers.sinks import ObservationSink

__all__ = ["ATTACKS", "Attack", "ObservationSink", "Reconstruction", "build_attack", "register_attack"]
