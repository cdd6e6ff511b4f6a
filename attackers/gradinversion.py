"""GradInversion (Yin et al., "See through Gradients: Image Batch Recovery via GradInversion", CVPR 2021).

Threat model: an honest server that also knows each BatchNorm layer's batch
mean and variance (grant ``bn-statistics``); on FedSGD uploads it reads them
off the uploaded buffers (``attackers.bn_statistics``). Labels come from the
last layer's gradient (``attackers.labels``) unless the client declared them.

Per job (one upload, one restart) it minimizes over dummy images ``x`` (B, C, H, W) in [0, 1]::

    gradient * sum_l ||grad_l(x) - g_l||^2 / sum_l ||g_l||^2          (L_grad)
    + tv * TV(x) + l2 * mean((x - 0.5)^2)                            (image prior)
    + bn * sum_l (||mu_l(x) - mu_l||_2 + ||var_l(x) - var_l||_2)     (BatchNorm statistics)
    + group * mean((x - mean over restarts of x)^2)                  (group consistency)

L_grad sums the squared distance over every parameter tensor ``l`` with one
weight (the paper's per-layer weights all equal), divided by the uploaded
gradient's squared norm so that the weights do not depend on the model's
gradient scale (1 for a zero dummy gradient). ``TV`` is
``attackers.inverting_gradients.total_variation`` averaged over the batch.
The paper's l2 prior acts on normalized images, i.e. pulls towards the data
mean; on raw [0, 1] pixels its analogue pulls towards mid-grey. ``mu_l`` and
``var_l`` are the per-channel mean and biased variance of BatchNorm layer
``l``'s input; the dummy batch's come from the forward pass that yields its
gradient (forward hooks on the BatchNorm modules, inside the vmapped
function). The group term, on from ``group_start`` (a fraction of the
iterations), pulls every restart of one upload towards their mean (detached,
recomputed each iteration); the paper first registers the restarts to each
other, here the plain mean is used: with the sorted labels fixing each
position's class, restarts mostly agree on which image sits where.

Optimizer: Adam (as the paper), step ``lr`` on [0, 1] pixels with cosine
decay to 0 over the iterations, pixels clamped to [0, 1] after each step.
The best restart of each upload is the one with the lowest final loss
without the group term. Defaults are for small images and small BatchNorm
networks (the paper inverts ResNet-50 gradients of 224x224 ImageNet batches,
with many more iterations): on randomly initialized BatchNorm networks gradient matching
alone stalls, and the BatchNorm term is what lets it converge; ``bn`` = 0.1
won over 0.01-10 on the attacks preset (batches of 4 digits through
a BatchNorm MLP; ``benchmarks/attack_defaults.py --case gradinversion-mlp``);
``tv`` and ``l2`` are the small image priors of DeepInversion-style attacks;
``group`` = 0.01 from half-way on.

A preset of the attack engine (``attackers.engine``): all restarts of all
uploads given together run as one batched search; only restarts of the same
upload interact, through the group term.
"""

from __future__ import annotations

from dataclasses import dataclass

from attackers.base import check_search_params, class_traits, register_attack
from attackers.bn_statistics import require_batch_norm
from attackers.engine import OptimizationAttack, OptimizerSpec, SearchSpec, Term


@dataclass(frozen=True)
class GradInversionParams:
    """``iterations``: Adam iterations; ``restarts``: random starts per upload (a group), the best kept; ``lr``: Adam
    step on [0, 1] pixels (cosine decay); ``device``: 'auto', 'cpu' or 'cuda'; ``gradient``: loss weight of the
    squared L2 gradient distance over the upload's squared norm; ``tv``: loss weight of the total variation;
    ``l2``: loss weight of the pixels' squared distance to 0.5; ``bn``: loss weight of the BatchNorm statistics
    distance; ``group``: loss weight of the distance to the restarts' mean, on from ``group_start``;
    ``group_start``: when the group term starts, a fraction of the iterations in [0, 1];
    ``compile``: 'auto' (compile where it pays), 'on' or 'off' (``attackers.engine.compiled``)."""

    iterations: int = 2000
    restarts: int = 4
    lr: float = 0.1
    device: str = "auto"
    gradient: float = 1.0
    tv: float = 1e-4
    l2: float = 1e-6
    bn: float = 0.1
    group: float = 0.01
    group_start: float = 0.5
    compile: str = "auto"

    def __post_init__(self) -> None:
        check_search_params(self.iterations, self.restarts, self.lr, self.device, self.compile)
        for name in ("gradient", "tv", "l2", "bn", "group"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.group_start <= 1:
            raise ValueError(f"group_start must be a fraction of the iterations in [0, 1], got {self.group_start}")


class GradInversion(OptimizationAttack):
    """Gradient matching with image, BatchNorm and group-consistency priors, Adam with cosine decay."""

    needs = frozenset({"bn-statistics"})
    check_model = staticmethod(require_batch_norm)  # the statistics are recovered from every upload, bn = 0 too

    def spec_of(self, params: GradInversionParams) -> SearchSpec:
        return SearchSpec(
            params.iterations,
            params.restarts,
            params.device,
            compile=params.compile,
            distance="relative-l2",
            distance_weight=params.gradient,
            terms=(
                Term("tv", params.tv),
                Term("l2", params.l2),
                Term("bn", params.bn),
                Term("group", params.group, start=params.group_start, selects=False),
            ),
            labels="infer",
            optimizer=OptimizerSpec("adam", params.lr, schedule="cosine"),
        )


@register_attack("gradinversion", params=GradInversionParams, traits=class_traits(GradInversion))
def build_gradinversion(params: GradInversionParams) -> GradInversion:
    """GradInversion (Yin et al. 2021): L2 gradient matching + image, BatchNorm and group priors, Adam, restarts."""
    return GradInversion(params)
