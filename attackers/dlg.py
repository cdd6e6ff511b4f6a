"""Deep Leakage from Gradients (Zhu et al., NeurIPS 2019) and iDLG (Zhao et al., 2020).

DLG minimizes the squared L2 distance between the gradient of dummy data and
the captured gradient, optimizing the images and soft labels (logits whose
softmax is the target distribution) together with L-BFGS. iDLG infers the
labels analytically from the last layer (``attackers.labels``) and optimizes
the images only. Labels the threat model grants are used by both.

A preset of the attack engine (``attackers.engine``): restarts and uploads
run together, each job with its own L-BFGS history and line search; a job
whose step overshoots shrinks its own step instead of freezing, and one whose
loss turns non-finite (a known failure of DLG) restarts from a fresh random
point. Restarts that end far from the gradient are what ``restarts`` is for
(DLG either converges or stays noise).
"""

from __future__ import annotations

from dataclasses import dataclass

from attackers.base import check_search_params, class_traits, register_attack
from attackers.engine import OptimizationAttack, OptimizerSpec, SearchSpec
from attackers.engine.optimizers import LINE_SEARCHES


@dataclass(frozen=True)
class DLGParams:
    """``iterations``: L-BFGS iterations; ``restarts``: random starts per upload, the best kept; ``lr``: the L-BFGS
    step; ``history``: L-BFGS history length; ``line_search``: 'none' (a fixed step, as ``torch.optim.LBFGS`` by
    default) or 'fractions' (the best of fixed fractions of the step); ``device``: 'auto', 'cpu' or 'cuda';
    ``compile``: 'auto' (compile where it pays), 'on' or 'off' (``attackers.engine.compiled``)."""

    iterations: int = 2000
    restarts: int = 1
    lr: float = 1.0
    history: int = 10
    line_search: str = "fractions"
    device: str = "auto"
    compile: str = "auto"

    def __post_init__(self) -> None:
        check_search_params(self.iterations, self.restarts, self.lr, self.device, self.compile)
        if self.history < 1:
            raise ValueError(f"history must be >= 1, got {self.history}")
        if self.line_search not in LINE_SEARCHES:
            raise ValueError(f"line_search {self.line_search!r}: choose one of {', '.join(LINE_SEARCHES)}")


class DeepLeakage(OptimizationAttack):
    """DLG (joint soft labels) or iDLG (analytic labels): L2 gradient matching with L-BFGS."""

    sums = frozenset({"gradient"})  # a FedSGD aggregate: the gradient of one batch, the union

    def __init__(self, params: DLGParams, infer: bool) -> None:
        self.infer = infer
        super().__init__(params)

    def spec_of(self, params: DLGParams) -> SearchSpec:
        return SearchSpec(
            params.iterations,
            params.restarts,
            params.device,
            compile=params.compile,
            distance="l2",
            labels="infer" if self.infer else "joint",
            optimizer=OptimizerSpec(
                "lbfgs", params.lr, history=params.history, line_search=params.line_search, box=False
            ),
        )


@register_attack("dlg", params=DLGParams, traits=class_traits(DeepLeakage))
def build_dlg(params: DLGParams) -> DeepLeakage:
    """DLG (Zhu et al. 2019): L2 gradient matching, L-BFGS, images and soft labels optimized jointly."""
    return DeepLeakage(params, infer=False)


@register_attack("idlg", params=DLGParams, traits=class_traits(DeepLeakage))
def build_idlg(params: DLGParams) -> DeepLeakage:
    """iDLG (Zhao et al. 2020): DLG with the labels inferred from the last layer's gradient."""
    return DeepLeakage(params, infer=True)
