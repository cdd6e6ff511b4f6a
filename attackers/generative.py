"""A generative-prior attack in the spirit of GGL (Li et al., "Auditing Privacy Defenses in Federated Learning
via Generative Gradient Leakage", CVPR 2022), on FedSGD gradients.

Threat model: the attacker holds public data like the clients' (not theirs)
and trained a generator on it (``fedguard train-generator``). It then searches
the generator's latent space instead of pixel space: minimize
``distance(grad(G(z)), g) + kl * KL(z)`` over latents ``z`` (B, latent_dim)
per restart, where ``KL(z)`` is GGL's regularizer: the KL divergence from
N(0, 1) of a normal with the mean and variance of each latent's entries,
averaged over the batch; it keeps ``z`` where the generator was trained. GGL
searches with gradient-free CMA-ES or Bayesian optimization; here the search
is Adam on ``z``, with the learning rate divided by 10 at 3/8, 5/8 and 7/8 of
the iterations, since the whole pipeline is differentiable. Labels come from
the last layer's gradient unless the threat model grants them.

A preset of the attack engine (``attackers.engine``) on the generator's latent
space: all restarts of all uploads given together run as one batched search,
one decoder call on every latent per evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attackers.base import AttackTraits, check_search_params, register_attack
from attackers.engine import OptimizationAttack, OptimizerSpec, SearchSpec, Term
from attackers.generators.store import load_generator, missing_generator
from fedguard.registry import RequiredFile

DISTANCES = ("cosine", "l2")
NO_GENERATOR = (
    "attack 'ggl' needs a generator: set attack.ggl.generator to a file made by "
    "`fedguard train-generator --data <dataset>` (by default generators/<dataset>.npz)"
)


@dataclass(frozen=True)
class GenerativeParams:
    """``generator``: a ``.npz`` from ``fedguard train-generator`` (required); ``iterations``: Adam iterations;
    ``restarts``: random starts per upload, the best kept; ``lr``: Adam step on the latents; ``device``: 'auto',
    'cpu' or 'cuda'; ``distance``: 'cosine' (1 - cosine similarity) or 'l2' (squared
    Euclidean) between gradients; ``kl``: weight of the latent prior;
    ``compile``: 'auto' (compile where it pays), 'on' or 'off' (``attackers.engine.compiled``)."""

    generator: str = ""
    iterations: int = 500
    restarts: int = 4
    lr: float = 0.1
    device: str = "auto"
    distance: str = "cosine"
    kl: float = 0.01
    compile: str = "auto"

    def __post_init__(self) -> None:
        check_search_params(self.iterations, self.restarts, self.lr, self.device, self.compile)
        if self.distance not in DISTANCES:
            raise ValueError(f"distance {self.distance!r}: choose one of {', '.join(DISTANCES)}")
        if self.kl < 0:
            raise ValueError(f"kl must be >= 0, got {self.kl}")


class GenerativeAttack(OptimizationAttack):
    """Latent search of a trained generator for images whose gradient matches, Adam with step decay."""

    def __init__(self, params: GenerativeParams) -> None:
        if not params.generator:
            raise ValueError(NO_GENERATOR)
        super().__init__(params)
        self.generator = load_generator(Path(params.generator))

    @property
    def decoder(self) -> Any:
        """The generator's decoder, whose latents the search explores."""
        return self.generator.decoder

    def spec_of(self, params: GenerativeParams) -> SearchSpec:
        return SearchSpec(
            params.iterations,
            params.restarts,
            params.device,
            compile=params.compile,
            distance=params.distance,
            terms=(Term("kl", params.kl),),
            labels="infer",
            optimizer=OptimizerSpec("adam", params.lr, schedule="step", box=False),
        )


def generative_traits(params: GenerativeParams) -> AttackTraits:
    """The class's traits and the generator file it loads."""
    generator = RequiredFile(
        "generator", params.generator, NO_GENERATOR, missing_generator(params.generator), load_generator
    )
    return AttackTraits.of(GenerativeAttack, files=(generator,))


@register_attack("ggl", params=GenerativeParams, traits=generative_traits)
def build_generative(params: GenerativeParams) -> GenerativeAttack:
    """Generative gradient leakage (after Li et al. 2022): latent search of a generator trained on public data."""
    return GenerativeAttack(params)
