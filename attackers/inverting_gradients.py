"""Inverting Gradients (Geiping et al., NeurIPS 2020), on FedSGD gradients and FedAvg weight updates.

Find images whose gradient points the same way as the captured one:
minimize ``1 - cos(grad(x), g) + tv * TV(x)`` over dummy images ``x`` with
Adam on the sign of the gradient, boxed to [0, 1], with the learning rate
divided by 10 at 3/8, 5/8 and 7/8 of the iterations (the paper's ``step``
schedule; ``schedule = "cosine"`` decays it along a half cosine to 0, which
reaches a given quality in fewer iterations on the ConvNet-64). Labels come from the
last layer's gradient (``attackers.labels``) unless the threat model grants
them. On FedAvg weights the attacker replays the client's declared local
steps (learning rate, epochs, batch size) on the dummy data and matches
``global - uploaded`` weights instead of the gradient.

Adaptive variants: ``skip`` leaves the layers a defense is known to alter
out of the distance (the fair test of Soteria); ``eot`` > 0 is expectation
over transformation against a randomized defense the server knows (threat
``defense``): each evaluation passes the dummy update through ``eot`` fresh
draws of the defense (``simulate``) and averages the distances.

A preset of the attack engine (``attackers.engine``): all restarts of all
uploads given together run as one batched search.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from attackers.base import AttackTraits, check_search_params, register_attack
from attackers.engine import OptimizationAttack, OptimizerSpec, SearchSpec, Term
from attackers.engine.optimizers import check_schedule
from attackers.engine.spec import check_precision, leaves_some


@dataclass(frozen=True)
class InvertingGradientsParams:
    """``iterations``: signed-Adam iterations; ``restarts``: random starts per upload, the best kept; ``lr``:
    signed-Adam step on [0, 1] pixels; ``tv``: weight of the total-variation prior; ``device``: 'auto', 'cpu' or 'cuda';
    ``skip``: comma-separated parameter-name prefixes left out of the distance (the layers a defense alters),
    ``eot``: draws of the known defense averaged per iteration (0: off; needs threat.defense);
    ``compile``: 'auto' (compile where it pays), 'on' or 'off' (``attackers.engine.compiled``);
    ``precision``: 'float32' or 'bfloat16', the arithmetic of the dummy gradient (``SearchSpec``);
    ``schedule``: the learning rate's decay, 'step' (the paper's: / 10 at 3/8, 5/8, 7/8), 'cosine' or 'none'."""

    iterations: int = 2000
    restarts: int = 1
    lr: float = 0.025
    tv: float = 0.01
    device: str = "auto"
    skip: str = ""
    eot: int = 0
    compile: str = "auto"
    precision: str = "float32"
    schedule: str = "step"

    def __post_init__(self) -> None:
        check_search_params(self.iterations, self.restarts, self.lr, self.device, self.compile)
        check_precision(self.precision)
        check_schedule(self.schedule)
        if self.tv < 0:
            raise ValueError(f"tv must be >= 0, got {self.tv}")
        if self.eot < 0:
            raise ValueError(f"eot must be >= 0 (0: off), got {self.eot}")


class InvertingGradients(OptimizationAttack):
    """Cosine-similarity gradient inversion with a TV prior, signed Adam with step decay."""

    needs_by_upload: Mapping[str, frozenset[str]] = {"weights": frozenset({"hyperparameters"})}
    uploads = frozenset({"gradient", "weights"})
    sums = frozenset({"gradient"})  # a FedSGD aggregate: the gradient of one batch, the union

    def __init__(self, params: InvertingGradientsParams) -> None:
        super().__init__(params)
        self.needs = inverting_gradients_traits(params).needs

    def spec_of(self, params: InvertingGradientsParams) -> SearchSpec:
        return SearchSpec(
            params.iterations,
            params.restarts,
            params.device,
            compile=params.compile,
            distance="cosine",
            skip=params.skip,
            terms=(Term("tv", params.tv),),
            labels="infer",
            optimizer=OptimizerSpec("signed-adam", params.lr, schedule=params.schedule),
            uploads=self.uploads,
            eot=params.eot,
            precision=params.precision,
        )

    def know_defense(self, defense: Any) -> None:
        """The clients' defense, simulated for EOT (its traits say it can simulate itself)."""
        self.defense = defense


def inverting_gradients_traits(params: InvertingGradientsParams) -> AttackTraits:
    """The class's traits; with ``eot`` > 0 it also needs the clients' defense, and one that can simulate itself;
    ``skip`` or ``eot`` make it adaptive."""
    return AttackTraits.of(
        InvertingGradients,
        needs=frozenset({"defense"}) if params.eot else frozenset(),
        simulates_defense=params.eot > 0,
        adaptive=bool(params.skip) or params.eot > 0,
        check_model=leaves_some(params.skip) if params.skip else None,
    )


@register_attack("ig", params=InvertingGradientsParams, traits=inverting_gradients_traits)
def build_inverting_gradients(params: InvertingGradientsParams) -> InvertingGradients:
    """Inverting Gradients (Geiping et al. 2020): cosine distance + TV, signed Adam, restarts."""
    return InvertingGradients(params)
