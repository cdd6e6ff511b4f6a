"""The batched optimization engine every gradient-inversion attack is a preset of.

``SearchSpec`` (``spec``) names the pieces: a gradient distance and priors (``terms``), a search space
(``spaces``), an optimizer and schedule (``optimizers``), a label strategy; ``search`` runs it on a group of
uploads; ``OptimizationAttack`` (``attack``) is the base class of a preset.
"""

from attackers.engine.attack import OptimizationAttack
from attackers.engine.optimizers import OptimizerSpec
from attackers.engine.search import search
from attackers.engine.spec import SearchSpec
from attackers.engine.terms import Term

__all__ = ["OptimizationAttack", "OptimizerSpec", "SearchSpec", "Term", "search"]
