"""What a malicious server may do to the model it sends, and the manipulation registry.

A manipulation is a callable ``manipulation(arrays, card, rng) -> arrays``: it
receives the global model's ``state_dict`` arrays (in ``card.names`` order) and
returns the arrays the server sends instead (same shapes and dtypes) to every
node of the round. It may only change values, never the architecture the
clients build. The attack that exploits a manipulation names it in its
``manipulation`` attribute and is run only on uploads computed on a model so
manipulated.

A ``ClientManipulation`` instead sends each node its own model, chosen from that
node's earlier uploads (a search across rounds, e.g. feature fishing), and hands
the attack what it derives from them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import numpy as np

from fedguard.observation import ModelCard, Observation
from fedguard.registry import Registry

HONEST = "none"


class Manipulation(Protocol):
    """A malicious server's change to the parameters it distributes."""

    def __call__(self, arrays: list[np.ndarray], card: ModelCard, rng: np.random.Generator) -> list[np.ndarray]: ...


@runtime_checkable
class ClientManipulation(Protocol):
    """A malicious server's search across rounds, one node at a time. Each node must upload the gradient of the
    same batch every round (FedSGD, each client's partition within ``train.batch-size``): the configuration
    checks it.

    ``check(arrays, card)`` raises ``ValueError`` when it cannot rewrite this model; ``send(node, arrays, card,
    rng)`` gives the arrays for ``node`` in place of the honest ``arrays``, or None to send them unchanged (the
    search is over for that node); ``learn(node, obs)`` takes the upload ``obs`` of ``node`` on what it was sent
    and returns the observation the attack inverts once the search has one (else None)."""

    def check(self, arrays: list[np.ndarray], card: ModelCard) -> None: ...

    def send(
        self, node: int, arrays: list[np.ndarray], card: ModelCard, rng: np.random.Generator
    ) -> list[np.ndarray] | None: ...

    def learn(self, node: int, obs: Observation) -> Observation | None: ...


ManipulationBuilder = Callable[[Any], Manipulation | ClientManipulation]

MANIPULATIONS: Registry[ManipulationBuilder] = Registry("manipulation")
register_manipulation = MANIPULATIONS.register


def build_manipulation(name: str, params: Any = None) -> Manipulation | ClientManipulation:
    """The registered manipulation ``name`` configured with ``params``."""
    return MANIPULATIONS.build(name, params=params)
