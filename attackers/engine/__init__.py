"""The batched optimization engine every gradient-inversion attack is a preset of.

``SearchSpec`` (``spec``) names the pieces: a gradient distance and priors (``terms``, where a plugin registers
its own with ``register_distance`` and ``register_prior``), a search space
(``spaces``), an optimizer and schedule (``optimizers``), a label strategy; ``search`` runs it on a group of
uploads; ``OptimizationAttack`` (``attack``) is the base class of a preset.
"""

from attackers.engine.attack import OptimizationAttack
from attackers.engine.optimizers import OptimizerSpec
from attackers.engine.search import search
from attackers.engine.spec import SearchSpec
from attackers.engine.terms import Term, register_distance, register_prior

__all__ = ["OptimizationAttack", "OptimizerSpec", "SearchSpec", "Term", "register_distance", "register_prior", "search"]
