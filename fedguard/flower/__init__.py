"""fedguard inside any Flower app: the client side as Flower mods (``defense_mod``, ``detect_mod``,
``truth_mod``, ``fedbn_mod``), the server side as a wrapper around the app's own strategy (``Audit``), both
configured by the run config's ``fedguard.*`` keys. ``docs/how-to/flower-app.md`` walks through it."""

from fedguard.flower.audit import Audit
from fedguard.flower.mods import defense_mod, detect_mod, fedbn_mod, truth_mod
from fedguard.flower.settings import PREFIX, audit_config

__all__ = ["PREFIX", "Audit", "audit_config", "defense_mod", "detect_mod", "fedbn_mod", "truth_mod"]
