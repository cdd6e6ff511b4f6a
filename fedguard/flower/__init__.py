"""fedguard inside any Flower app, configured by the run config's ``fedguard.*`` keys: the client side as Flower
mods (``defense_mod``, ``detect_mod``, ``truth_mod``, ``fedbn_mod``), the defenses that need the model and the
batch inside the app's own train function (``DefendedTraining``), and the server side as a wrapper around the
app's own strategy (``Audit``). ``docs/how-to/flower-app.md`` walks through it."""

from fedguard.flower.audit import Audit
from fedguard.flower.mods import defense_mod, detect_mod, fedbn_mod, truth_mod
from fedguard.flower.settings import PREFIX, audit_config
from fedguard.flower.training import DefendedTraining

__all__ = ["PREFIX", "Audit", "DefendedTraining", "audit_config", "defense_mod", "detect_mod", "fedbn_mod", "truth_mod"]
