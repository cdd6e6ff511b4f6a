"""The base of every optimization attack: its parameters make a ``SearchSpec``; the engine does the rest."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attackers.base import Reconstruction
from attackers.engine.search import search
from attackers.engine.spec import SearchSpec
from attackers.manipulation import HONEST
from fedguard.observation import Observation


class OptimizationAttack:
    """An honest-server attack that searches for the batch behind an upload.

    A subclass declares ``uploads`` (and ``needs``, ``needs_by_upload``) as class attributes and turns its
    parameters into a ``SearchSpec`` in ``spec_of``; ``decoder`` (a generator's) and ``defense`` (the clients',
    for EOT) are handed to the search when set."""

    needs: frozenset[str] = frozenset()
    needs_by_upload: Mapping[str, frozenset[str]] = {}
    uploads: frozenset[str] = frozenset({"gradient"})
    manipulation = HONEST
    decoder: Any = None
    defense: Any = None

    def __init__(self, params: Any) -> None:
        self.params = params
        self.spec = self.spec_of(params)

    def spec_of(self, params: Any) -> SearchSpec:
        """The search these parameters stand for."""
        raise NotImplementedError

    def reconstruct_many(self, observations: list[Observation], seed: int) -> list[Reconstruction]:
        """Reconstruct the batch behind each upload (one model, data shape and batch size), all in one batched
        search whose starting points ``seed`` gives (the same seed repeats exactly)."""
        return search(self.spec, observations, seed, decoder=self.decoder, defense=self.defense)
