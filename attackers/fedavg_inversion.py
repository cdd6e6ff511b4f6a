"""FedAvg inversion (Dimitrov et al., "Data Leakage in Federated Averaging", TMLR 2022): the client's local
training simulated with its shuffle unknown.

A FedAvg client reshuffles its examples every local epoch, so Inverting Gradients' replay, which cuts every
epoch's minibatches from one copy of the dummy batch in the same order, matches a training the client never ran.
This attack searches one copy of the N examples per local epoch (``attackers.engine.spaces.EpochCopiesSpace``):
epoch e's minibatches are cut in order from copy e, whose order is free; each copy's slots take the known labels
(the multiset read off the last layer, or declared) by a soft permutation searched with the pixels, so every
step's labels are searched within the counts. The epoch-order-invariant prior (``epoch-order``: a symmetric
Chamfer distance between copy 0 and every other copy) ties the copies into one set of images; the running
statistics every BatchNorm layer uploads (``running-stats``: the change its T steps made, T the declared
schedule's step count, checked against ``num_batches_tracked``) are matched too. The distance is IG's cosine,
the optimizer IG's signed Adam with its step schedule, TV its prior, so that a sweep compares the two on equal
budgets. The reconstruction is copy 0, each image averaged with its nearest in every other copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.nn as nn

from attackers.base import AttackTraits, check_search_params, register_attack
from attackers.bn_statistics import batch_norm_layers
from attackers.engine import OptimizationAttack, OptimizerSpec, SearchSpec, Term
from attackers.engine.optimizers import check_schedule
from attackers.engine.spec import check_precision, check_shuffle


@dataclass(frozen=True)
class FedAvgInversionParams:
    """``iterations``: signed-Adam iterations; ``restarts``: random starts per upload, the best kept; ``lr``:
    signed-Adam step on [0, 1] pixels (and on the label assignments' logits); ``tv``: weight of the
    total-variation prior; ``order``: weight of the epoch-order prior tying the copies; ``running``: weight of
    the running-statistics match (0: off, and a model without BatchNorm accepted); ``shuffle``: 'per-epoch'
    (one copy per epoch, the attack) or 'in-order' (IG's replay, for comparison); ``device``: 'auto', 'cpu' or
    'cuda'; ``compile``: 'auto', 'on' or 'off' (``attackers.engine.compiled``); ``precision``: 'float32' or
    'bfloat16', the arithmetic of the replay; ``schedule``: the learning rate's decay, 'step', 'cosine' or
    'none' (as Inverting Gradients')."""

    iterations: int = 2000
    restarts: int = 1
    lr: float = 0.025
    tv: float = 0.0001
    order: float = 1.0
    running: float = 0.1
    shuffle: str = "per-epoch"
    device: str = "auto"
    compile: str = "auto"
    precision: str = "float32"
    schedule: str = "step"

    def __post_init__(self) -> None:
        check_search_params(self.iterations, self.restarts, self.lr, self.device, self.compile)
        check_precision(self.precision)
        check_schedule(self.schedule)
        for name in ("tv", "order", "running"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite weight >= 0, got {value}")
        check_shuffle(self.shuffle)


class FedAvgInversion(OptimizationAttack):
    """The client's local epochs replayed on one searched copy of its examples each, tied by the epoch-order
    prior, its BatchNorm running statistics matched."""

    needs = frozenset({"hyperparameters"})
    uploads = frozenset({"weights"})

    def spec_of(self, params: FedAvgInversionParams) -> SearchSpec:
        terms = [Term("tv", params.tv), Term("epoch-order", params.order)]
        if params.running > 0:
            terms.append(Term("running-stats", params.running))
        return SearchSpec(
            params.iterations,
            params.restarts,
            params.device,
            compile=params.compile,
            distance="cosine",
            terms=tuple(terms),
            labels="infer",
            optimizer=OptimizerSpec("signed-adam", params.lr, schedule=params.schedule),
            uploads=self.uploads,
            precision=params.precision,
            shuffle=params.shuffle,
        )


def fedavg_inversion_traits(params: FedAvgInversionParams) -> AttackTraits:
    """The class's traits; matching the running statistics needs a model that keeps them."""
    return AttackTraits.of(FedAvgInversion, check_model=keeps_running_statistics if params.running > 0 else None)


def keeps_running_statistics(model: nn.Module) -> None:
    """Refuse a model with no BatchNorm running statistics to match (``running`` = 0 attacks it without)."""
    if not batch_norm_layers(model):
        raise ValueError(
            "the model has no BatchNorm layer with running statistics for fedavg-inversion to match: set "
            "attack.fedavg-inversion.running = 0, or choose a BatchNorm model (convnet, mlp with batch-norm)"
        )


@register_attack("fedavg-inversion", params=FedAvgInversionParams, traits=fedavg_inversion_traits)
def build_fedavg_inversion(params: FedAvgInversionParams) -> FedAvgInversion:
    """FedAvg inversion (Dimitrov et al. 2022): per-epoch copies, epoch-order prior, running statistics."""
    return FedAvgInversion(params)
