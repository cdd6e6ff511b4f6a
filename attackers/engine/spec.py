"""What an optimization attack is to the engine: a ``SearchSpec`` of registered pieces."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from attackers.base import check_search_params
from attackers.engine.optimizers import OptimizerSpec
from attackers.engine.terms import DISTANCES, Term
from fedguard.defenses.revealed import Revealed

LABELS = ("infer", "joint")
SHUFFLES = ("in-order", "per-epoch")
"""How a FedAvg client's minibatches are replayed: cut in order from one copy of the examples every epoch
(Geiping et al.), or from one searched copy per epoch whose order is free (Dimitrov et al., TMLR 2022)."""
PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""The dtype of the dummy update's arithmetic (the distance and the priors stay in float32)."""


@dataclass(frozen=True)
class SearchSpec:
    """A complete optimization attack.

    ``iterations`` and ``restarts`` per upload, ``device`` ('auto', 'cpu', 'cuda'); the gradient ``distance``
    (a key of ``DISTANCES``) with its weight, ``skip``: comma-separated parameter-name prefixes left out of it;
    prior ``terms``; ``labels``: 'infer' (declared by the client, else inferred from the last layer) or
    'joint' (declared, else searched as soft labels with the images); the ``optimizer``; ``uploads``: the upload
    kinds it attacks; ``eot``: draws of the clients' simulated defense averaged per evaluation (0: off);
    ``compile``: 'auto', 'on' or 'off' (``attackers.engine.compiled``); ``matching``: what the clients' defense
    reveals, when the attack knows it: the distance is then ``attackers.engine.aware``'s for it instead of
    ``distance`` (``aware_phases``), a sent band's penalty weighted by ``band_weight``, quantized levels matched
    with the rounding's likelihood late when ``rounding_likelihood``; ``precision``: the
    arithmetic of the dummy update, a key of ``PRECISIONS`` (``bfloat16``
    halves the cost of the convolutions on hardware with bfloat16 units, at about 3 significant digits);
    ``shuffle``: how a FedAvg upload's local epochs are replayed, a key of ``SHUFFLES``."""

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
    precision: str = "float32"
    matching: Revealed | None = None
    band_weight: float = 1.0
    rounding_likelihood: bool = False
    shuffle: str = "in-order"

    def __post_init__(self) -> None:
        check_search_params(self.iterations, self.restarts, self.optimizer.lr, self.device, self.compile)
        if self.distance not in DISTANCES:
            raise ValueError(f"distance {self.distance!r}: choose one of {', '.join(DISTANCES)}")
        if self.labels not in LABELS:
            raise ValueError(f"labels {self.labels!r}: choose one of {', '.join(LABELS)}")
        if self.eot < 0:
            raise ValueError(f"eot must be >= 0 (0: off), got {self.eot}")
        check_precision(self.precision)
        check_shuffle(self.shuffle)

    def skipped(self, name: str) -> bool:
        """True when parameter ``name`` is left out of the gradient distance."""
        return skipped_by(self.skip, name)

    def uses(self, prior: str) -> bool:
        """True when a term of the objective is ``prior`` (weighted or, at weight 0, only reported)."""
        return any(t.name == prior for t in self.terms)


def skipped_by(skip: str, name: str) -> bool:
    """True when one of the comma-separated prefixes ``skip`` starts parameter ``name``."""
    return any(name.startswith(prefix.strip()) for prefix in skip.split(",") if prefix.strip())


def leaves_some(skip: str) -> Callable[[nn.Module], None]:
    """A ``check_model`` refusing a model all of whose trainable parameters ``skip`` leaves out of the distance."""

    def check(model: nn.Module) -> None:
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        if names and all(skipped_by(skip, name) for name in names):
            raise ValueError(f"skip = {skip!r} leaves no parameter to compare; parameters: {', '.join(names)}")

    return check


def check_precision(precision: str) -> None:
    """Raises ``ValueError`` naming ``precision`` unless it is a key of ``PRECISIONS``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")


def check_shuffle(shuffle: str) -> None:
    """Raises ``ValueError`` naming ``shuffle`` unless it is one of ``SHUFFLES``."""
    if shuffle not in SHUFFLES:
        raise ValueError(f"shuffle {shuffle!r}: choose one of {', '.join(SHUFFLES)}")
