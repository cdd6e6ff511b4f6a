"""Mjölnir as a stage before a gradient-inversion attack: ``mjolnir+ig``, ``mjolnir+dlg``, ...

Threat model: the server of the inner attack, which also trained a gradient diffusion model on a
surrogate's clean gradients (``fedguard train-mjolnir``) and knows, or estimates, the noise level of the
perturbation the clients add. For each FedSGD upload it packs the trainable gradient with the model's
packing (``attackers.diffusion.packing``), denoises it with Algorithm 3 (``attackers.diffusion.denoise``) at
noise level M (the per-entry noise standard deviation divided by the packing scale), unpacks it, and hands
the upload with the denoised gradient to the inner attack. Where M comes from (``noise_source``):

- ``defense``: the clients' known defense (threat grant ``defense``): ``dp`` adds noise of standard
  deviation ``noise-multiplier * clip`` per entry, or what its epsilon calibration gives (Gaussian;
  sqrt(2) times that scale for Laplace);
  ``dp-sgd`` adds ``noise-multiplier * clip`` to a sum of B per-sample gradients, i.e. that divided by the
  batch B of the upload. Other defenses add no noise Mjölnir models, which is refused.
- ``given``: ``noise_std`` per entry, in gradient units.
- ``estimate``: from the upload itself, sqrt(max(mean(y^2) - P, 0)) with P the mean square of the training
  gradients the model records.

The denoiser file says which model it holds: the unconditional one (trained on clean gradients only) or
the conditional one ("Mjölnir (Condition)", ``fedguard train-mjolnir --conditional``), which is also given
the upload itself, rescaled by 1/sqrt(1 + M^2) with the same M, as its condition at every step of the same
chain. The sampler is Algorithm 3's chain (``chained``) or, for an unconditional model, the released code's
single reverse step (``single-step``; ``attackers.diffusion.denoise``). Clipping is not undone: the paper's
setting, whose clean gradients the model learned, is the same. Parameters of the inner attack keep their names
(``attack.mjolnir+ig.iterations``). The identity baseline of ``mjolnir+<attack>`` is ``<attack>`` with the
same parameters in the same run: it inverts the same noisy upload (same round and client) from the same
seeded starting points.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from attackers.base import ATTACKS, AttackTraits, Reconstruction, attack_traits, register_attack
from attackers.diffusion.denoise import SAMPLERS, VARIANCES, denoise_many, start_step
from attackers.diffusion.noise import estimate_noise_level
from attackers.diffusion.packing import pack_many, unpack_many, valid_mask
from attackers.diffusion.pipeline import check_shapes
from attackers.diffusion.store import load_ddpm, missing_ddpm
from fedguard.defenses.revealed import ClippedNoise, revealed_by
from fedguard.observation import Observation
from fedguard.registry import RequiredFile, field_help

INNER_ATTACKS = ("ig", "dlg", "idlg", "gradinversion", "ggl")
NOISE_SOURCES = ("defense", "given", "estimate")
NO_DENOISER = "Mjölnir needs a diffusion model: set denoiser to a file made by `fedguard train-mjolnir`"


@dataclasses.dataclass(frozen=True)
class MjolnirParams:
    """``denoiser``: a ``.npz`` from ``fedguard train-mjolnir`` (required); ``noise_source``: 'defense',
    'given' or 'estimate'; ``noise_std``: the per-entry noise standard deviation in gradient units, for
    'given'; ``variance``: reverse-step variance, 'beta' (Algorithm 3) or 'posterior'; ``seed``: seeds the reverse
    chain's noise; ``sampler``: 'chained' (Algorithm 3) or 'single-step' (the released code's one step; not for
    a conditional denoiser)."""

    denoiser: str = ""
    noise_source: str = "defense"
    noise_std: float = 0.0
    variance: str = "beta"
    seed: int = 0
    sampler: str = "chained"

    def __post_init__(self) -> None:
        if self.noise_source not in NOISE_SOURCES:
            raise ValueError(f"noise-source {self.noise_source!r}: choose one of {', '.join(NOISE_SOURCES)}")
        if not (math.isfinite(self.noise_std) and self.noise_std >= 0):
            raise ValueError(f"noise-std must be finite and >= 0, got {self.noise_std}")
        if self.noise_source == "given" and self.noise_std == 0:
            raise ValueError("noise-source 'given' needs noise-std > 0 (the per-entry noise standard deviation)")
        if self.variance not in VARIANCES:
            raise ValueError(f"variance {self.variance!r}: choose one of {', '.join(VARIANCES)}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler {self.sampler!r}: choose one of {', '.join(SAMPLERS)}")


def own_needs(params: MjolnirParams) -> frozenset[str]:
    """What Mjölnir needs beyond its inner attack: the clients' defense when it is the noise level's source."""
    return frozenset({"defense"}) if params.noise_source == "defense" else frozenset()


def defense_noise_std(defense: Any, batch_size: int) -> float:
    """Per-entry noise standard deviation, in gradient units, that ``defense`` adds to a batch-``batch_size``
    upload, as it declares it (``revealed()``: ``ClippedNoise``); ``ValueError`` for a defense that declares no
    additive noise."""
    revealed = revealed_by(defense)
    if isinstance(revealed, ClippedNoise):
        return revealed.std(batch_size)
    raise ValueError(
        f"Mjölnir denoises additive noise; the clients' defense {type(defense).__name__} adds none it "
        f"models (use defense dp or dp-sgd, or noise-source 'given' or 'estimate')"
    )


class Mjolnir:
    """Denoise each upload's gradient, then run the inner attack on the denoised uploads."""

    uploads: frozenset[str] = frozenset({"gradient"})

    def __init__(self, params: MjolnirParams, inner: Any) -> None:
        if not params.denoiser:
            raise ValueError(NO_DENOISER)
        self.params, self.inner = params, inner
        self.trained = load_ddpm(Path(params.denoiser))
        if self.trained.conditional and params.sampler != "chained":
            raise ValueError(
                f"sampler {params.sampler!r} is the released code's, for an unconditional denoiser; "
                f"{params.denoiser} holds a conditional one, which runs the sampler 'chained'"
            )
        self.needs: frozenset[str] = inner.needs | own_needs(params)
        self.needs_by_upload: Mapping[str, frozenset[str]] = {
            k: v for k, v in inner.needs_by_upload.items() if k in self.uploads
        }
        self.manipulation: str = inner.manipulation
        self.defense: Any = None

    def know_defense(self, defense: Any) -> None:
        """The clients' defense: the source of the noise level, and the inner attack's if it needs one."""
        self.defense = defense
        if "defense" in self.inner.needs:
            self.inner.know_defense(defense)

    def noise_std(self, obs: Observation) -> float | None:
        """The per-entry noise standard deviation of ``obs``'s gradient, in gradient units (None: estimate it)."""
        if self.params.noise_source == "given":
            return self.params.noise_std
        if self.params.noise_source == "defense":
            return defense_noise_std(self.defense, obs.declared.batch(obs.num_examples))
        return None

    def denoised(self, observations: list[Observation]) -> tuple[list[Observation], list[float], list[int]]:
        """The uploads with denoised gradients, each one's noise level M and start step."""
        first = observations[0]
        shapes = [a.shape for a, t in zip(first.upload, first.trainable) if t]
        spec = check_shapes(self.trained, shapes)
        grads = [
            torch.stack([torch.tensor(o.upload[i]) for o in observations])
            for i, trainable in enumerate(first.trainable)
            if trainable
        ]
        packed = pack_many(grads, spec)
        mask = valid_mask(spec)
        generator = torch.Generator().manual_seed(self.params.seed)
        levels = []
        for index, obs in enumerate(observations):
            std = self.noise_std(obs)
            levels.append(
                float(std / spec.scale)
                if std is not None
                else estimate_noise_level(
                    packed[index : index + 1], self.trained.normalization.get("signal_power", 1.0), mask
                )
            )
        cleaned = denoise_many(
            self.trained.model,
            self.trained.schedule,
            packed,
            levels,
            generator,
            self.params.variance,
            self.params.sampler,
            self.trained.conditional,
        )
        starts = [start_step(self.trained.schedule, level) for level in levels]
        restored = unpack_many(cleaned, spec)
        uploads = []
        for index, obs in enumerate(observations):
            parts = iter(tensor[index].numpy().astype(obs.upload[0].dtype) for tensor in restored)
            upload = [next(parts) if t else a for a, t in zip(obs.upload, obs.trainable)]
            uploads.append(dataclasses.replace(obs, upload=upload))
        return uploads, levels, starts

    def reconstruct_many(self, observations: list[Observation], seed: int) -> list[Reconstruction]:
        """Denoise, then the inner attack's reconstructions from the starting points ``seed`` gives, with M and
        the start step in their stats."""
        if not observations:
            return []
        uploads, levels, starts = self.denoised(observations)
        results = self.inner.reconstruct_many(uploads, seed)
        for result, upload, level, start in zip(results, uploads, levels, starts):
            result.stats.update({"mjolnir_noise_level": level, "mjolnir_start_step": start})
            result.gradient = [a for a, t in zip(upload.upload, upload.trainable) if t]
        return results


def _composed_params(inner: str) -> type:
    """A frozen dataclass with Mjölnir's fields, then the inner attack's (one config table per composition)."""
    inner_params = ATTACKS.get(inner).params
    fields = [(f.name, f.type, f, field_help(MjolnirParams, f.name)) for f in dataclasses.fields(MjolnirParams)]
    fields += [(f.name, f.type, f, field_help(inner_params, f.name)) for f in dataclasses.fields(inner_params)]

    def post_init(self: Any) -> None:
        split(self)

    def split(self: Any) -> tuple[MjolnirParams, Any]:
        values = dataclasses.asdict(self)
        own = {f.name for f in dataclasses.fields(MjolnirParams)}
        return (
            MjolnirParams(**{k: v for k, v in values.items() if k in own}),
            inner_params(**{k: v for k, v in values.items() if k not in own}),
        )

    name = f"Mjolnir{inner.title().replace('-', '')}Params"
    return dataclasses.make_dataclass(
        name,
        [(n, t, dataclasses.field(default=f.default, metadata={"help": h})) for n, t, f, h in fields],
        frozen=True,
        namespace={"__post_init__": post_init, "split": split, "__doc__": f"Mjölnir's parameters, then {inner}'s."},
    )


def mjolnir_traits(inner: str) -> Callable[[Any], AttackTraits]:
    """``traits(params)`` of ``mjolnir+<inner>``: the inner attack's, on the uploads Mjölnir denoises, with
    Mjölnir's own needs and its denoiser file; adaptive when the inner attack is or when the noise level comes
    from the clients' defense (noise-source 'defense'; 'given' and 'estimate' do not read the defense)."""

    def traits(params: Any) -> AttackTraits:
        own, inner_params = params.split()
        inside = attack_traits(inner, inner_params)
        denoiser = RequiredFile("denoiser", own.denoiser, NO_DENOISER, missing_ddpm(own.denoiser), load_ddpm)
        return dataclasses.replace(
            inside,
            uploads=Mjolnir.uploads,
            needs=inside.needs | own_needs(own),
            adaptive=inside.adaptive or own.noise_source == "defense",
            needs_by_upload={k: v for k, v in inside.needs_by_upload.items() if k in Mjolnir.uploads},
            files=(denoiser, *inside.files),
        )

    return traits


def _register(inner: str) -> None:
    params_type = _composed_params(inner)

    def build(params: Any) -> Mjolnir:
        own, inner_params = params.split()
        return Mjolnir(own, ATTACKS.get(inner).factory(inner_params))

    build.__doc__ = f"Mjölnir (Liu et al. 2025): denoise DP-protected gradients with a diffusion model, then {inner}."
    register_attack(f"mjolnir+{inner}", params=params_type, traits=mjolnir_traits(inner))(build)


for _inner in INNER_ATTACKS:
    _register(_inner)
