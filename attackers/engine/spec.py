"""What an optimization attack is to the engine: a ``SearchSpec`` of registered pieces."""

from __future__ import annotations

from dataclasses import dataclass

from attackers.base import check_search_params
from attackers.engine.optimizers import OptimizerSpec
from attackers.engine.terms import DISTANCES, Term

LABELS = ("infer", "joint")


@dataclass(frozen=True)
class SearchSpec:
    """A complete optimization attack.

    ``iterations`` and ``restarts`` per upload, ``device`` ('auto', 'cpu', 'cuda'); the gradient ``distance``
    (a key of ``DISTANCES``) with its weight, ``skip``: comma-separated parameter-name prefixes left out of it;
    prior ``terms``; ``labels``: 'infer' (declared by the client, else inferred from the last layer) or
    'joint' (declared, else searched as soft labels with the images); the ``optimizer``; ``uploads``: the upload
    kinds it attacks; ``eot``: draws of the clients' simulated defense averaged per evaluation (0: off);
    ``compile``: 'auto', 'on' or 'off' (``attackers.engine.compiled``)."""

    iterations: int
    restarts: int
    device: str = "auto"
    distance: str = "cosine"
    distance_weight: float = 1.0
    skip: str = ""
    terms: tuple[Term, ...] = ()
    labels: str = "infer"
    optimizer: OptimizerSpec = OptimizerSpec()
    uploads: frozenset[str] = frozenset({"gradient"})
    eot: int = 0
    compile: str = "auto"

    def __post_init__(self) -> None:
        check_search_params(self.iterations, self.restarts, self.optimizer.lr, self.device, self.compile)
        if self.distance not in DISTANCES:
            raise ValueError(f"distance {self.distance!r}: choose one of {', '.join(DISTANCES)}")
        if self.labels not in LABELS:
            raise ValueError(f"labels {self.labels!r}: choose one of {', '.join(LABELS)}")
        if self.eot < 0:
            raise ValueError(f"eot must be >= 0 (0: off), got {self.eot}")

    def skipped(self, name: str) -> bool:
        """True when parameter ``name`` is left out of the gradient distance."""
        return any(name.startswith(prefix.strip()) for prefix in self.skip.split(",") if prefix.strip())

    def uses(self, prior: str) -> bool:
        """True when a term of the objective is ``prior`` (weighted or, at weight 0, only reported)."""
        return any(t.name == prior for t in self.terms)
