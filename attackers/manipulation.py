"""What a malicious server may do to the model it sends, and the manipulation registry.

A manipulation is a callable ``manipulation(arrays, card, rng) -> arrays``: it
receives the global model's ``state_dict`` arrays (in ``card.names`` order) and
returns the arrays the server sends instead (same shapes and dtypes). It may
only change values, never the architecture the clients build. The attack
that exploits a manipulation names it in its ``manipulation`` attribute and
is run only on uploads computed on a model so manipulated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from fedguard.observation import ModelCard
from fedguard.registry import Registry

HONEST = "none"


class Manipulation(Protocol):
    """A malicious server's change to the parameters it distributes."""

    def __call__(self, arrays: list[np.ndarray], card: ModelCard, rng: np.random.Generator) -> list[np.ndarray]: ...


ManipulationBuilder = Callable[[Any], Manipulation]

MANIPULATIONS: Registry[ManipulationBuilder] = Registry("manipulation")
register_manipulation = MANIPULATIONS.register


def build_manipulation(name: str, params: Any = None) -> Manipulation:
    """The registered manipulation ``name`` configured with ``params``."""
    return MANIPULATIONS.build(name, params=params)
