"""An attack of one's own, outside the fedguard package: cosine gradient matching with a strong TV prior,
searched by plain Adam with cosine decay. Select it from the configuration::

    fedguard run experiments/quickstart.toml --set server.plugins=extensions.smooth_inversion \
        --set attack.name=smooth-inversion --set attack.smooth-inversion.tv=0.01
"""

from __future__ import annotations

from dataclasses import dataclass

from attackers.base import check_search_params, class_traits, register_attack
from attackers.engine import OptimizationAttack, OptimizerSpec, SearchSpec, Term


@dataclass(frozen=True)
class SmoothInversionParams:
    """``iterations``: Adam iterations; ``restarts``: random starts per upload, the best kept; ``lr``: Adam step on
    [0, 1] pixels; ``tv``: weight of the TV prior; ``device``: 'auto', 'cpu' or 'cuda'."""

    iterations: int = 500
    restarts: int = 1
    lr: float = 0.05
    tv: float = 0.01
    device: str = "auto"

    def __post_init__(self) -> None:
        check_search_params(self.iterations, self.restarts, self.lr, self.device)


class SmoothInversion(OptimizationAttack):
    """1 - cos(grad(x), g) + tv * TV(x), Adam with cosine decay, labels inferred unless granted."""

    def spec_of(self, params: SmoothInversionParams) -> SearchSpec:
        return SearchSpec(
            params.iterations,
            params.restarts,
            params.device,
            distance="cosine",
            terms=(Term("tv", params.tv),),
            optimizer=OptimizerSpec("adam", params.lr, "cosine"),
        )


@register_attack("smooth-inversion", params=SmoothInversionParams, traits=class_traits(SmoothInversion))
def build_smooth_inversion(params: SmoothInversionParams) -> SmoothInversion:
    """Cosine matching with a strong TV prior, plain Adam (an example of a user's own attack)."""
    return SmoothInversion(params)
