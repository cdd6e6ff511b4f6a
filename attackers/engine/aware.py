"""Defense-aware gradient distances: what an attacker who knows the clients' defense matches instead of the
plain cosine (``fedguard.defenses.revealed`` says what each defense's upload reveals).

Every distance takes the dummy gradients ``g`` and the uploaded targets ``t`` (lists of (J, ...) tensors, one
per compared parameter) and returns (J,). Where the defense bounds entries in absolute units (level steps,
magnitude bands) the dummy gradient is first brought to the upload's scale by the least-squares factor
``s = <g, t> / <g, g>`` over what was sent, so that no distance can be lowered by shrinking ``g``:

- ``Unchanged``, ``Undeclared``, ``AlteredLayer``: ``1 - cos(g, t)`` (the altered layer is left out by the
  attack's ``skip``).
- ``SentBand``: ``1 - cos(m g, t)`` over the sent entries (``m = t != 0``) plus, per tensor, the squared
  distance of each unsent ``|s g|`` to the region the defense left it in (at most the smallest sent magnitude;
  for DGP also at least the largest), over ``||t||^2``, times the attack's ``band`` weight.
- ``QuantizedLevels``: the mean over entries of ``-log(1 - |s g - t| / step)``, ``step`` being each tensor's
  level step ``(max t - min t) / (2**bits - 1)``: unbiased stochastic rounding sends an entry ``d < 1`` steps
  from a level to it with probability ``1 - d``, so this is the upload's negative log-likelihood per entry
  (``rounding_nll``; a constant tensor, sent exactly, is left out). The search matches the cosine, and this
  only when asked, late and beside the cosine (``aware_phases``).
- ``TowardsRobustData``: ``1 - cos(g, t)``, ``g`` being the gradient of the true and the robust images mixed
  with the searched robust share (``attackers.engine.spaces.RobustMixtureSpace``): Refiner's upload exactly.
- ``WithinRadius`` (Refiner read as a ball only): ``relu(||g - t|| - r)^2 / ||t||^2``: zero for every gradient
  the defense could have moved to ``t`` (``r = epsilon ||t|| / (1 - epsilon)`` bounds a relative radius
  ``epsilon ||g||`` from ``t``), so that the image prior alone chooses among them.
- ``OrthogonalPerTensor``: the mean over tensors of ``cos(g_l, t_l)^2 + (||g_l|| / ||t_l|| - 1)^2``: the
  candidate is orthogonal to the true gradient tensor by tensor and of its norm. Under a raw fallback the upload
  may also be the gradient itself, which the upload does not mark: the distance is then the smaller of that
  and ``1 - cos(g, t)``, zero at the true gradient under either case.
- ``ClippedNoise``: ``||clip(g) - t||^2 / ||t||^2``, the Gaussian likelihood of the upload around the clipped
  update (its expectation), ``clip`` scaling ``g`` to norm at most ``C``.
"""

from __future__ import annotations

from typing import cast

import torch

from attackers.engine.terms import Distance, cosine_distance, dot, l2_distance
from fedguard.defenses.dp_update import clip_per_job
from fedguard.defenses.quantization import level_grid
from fedguard.defenses.revealed import (
    AlteredLayer,
    ClippedNoise,
    OrthogonalPerTensor,
    QuantizedLevels,
    Revealed,
    SentBand,
    TowardsRobustData,
    Unchanged,
    Undeclared,
    WithinRadius,
)

EPS = 1e-12
ROUNDING_MARGIN = 0.05
"""How far below one level step (in steps) the rounding likelihood's negative log turns into a line."""
LIKELIHOOD_START = 0.75
"""The fraction of the iterations after which the rounding likelihood joins the cosine, when asked
(``aware_phases``)."""
LIKELIHOOD_WEIGHT = 0.01
"""Its weight beside the cosine: near the cosine's optimum the likelihood per entry is about 0.5 (the mean binary
entropy of the rounding) against a cosine distance of about 0.02, so that at weight 1 it would drown the image
prior, whose weight was chosen beside the cosine."""


def _scale(g: list[torch.Tensor], t: list[torch.Tensor]) -> torch.Tensor:
    """(J,) least-squares factor ``s`` minimizing ``||s g - t||`` (1 where ``g`` is zero)."""
    gg = dot(g, g)
    return torch.where(gg > EPS, dot(g, t) / gg.clamp_min(EPS), torch.ones_like(gg))


def _per_job(s: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return s.reshape(-1, *[1] * (like.dim() - 1))


def band_distance(drops_top: bool, weight: float = 1.0) -> Distance:
    """Masked cosine over the sent entries plus ``weight`` times the unsent entries' distance to where the defense
    left them."""

    def distance(g: list[torch.Tensor], t: list[torch.Tensor]) -> torch.Tensor:
        masks = [(x != 0).to(x.dtype) for x in t]
        sent = [x * m for x, m in zip(g, masks)]
        s = _scale(sent, t)
        outside: torch.Tensor | float = 0
        for x, target, m in zip(g, t, masks):
            flat, tflat, mflat = x.flatten(1), target.flatten(1), m.flatten(1)
            magnitude = (_per_job(s, flat) * flat).abs()
            big = torch.finfo(tflat.dtype).max
            lo = torch.where(mflat > 0, tflat.abs(), big).amin(1, keepdim=True)
            hi = (tflat.abs() * mflat).amax(1, keepdim=True)
            above = torch.relu(magnitude - lo)
            gap = torch.minimum(above, torch.relu(hi - magnitude)) if drops_top else above
            outside = outside + ((1 - mflat) * gap**2).sum(1)
        return cosine_distance(sent, t) + weight * outside / dot(t, t).clamp_min(EPS)

    return distance


def rounding_nll(d: torch.Tensor) -> torch.Tensor:
    """``-log(1 - d)`` per entry ``d`` level steps from its upload: the negative log of the probability that
    unbiased stochastic rounding sent it there (zero beyond one step), continued from ``1 - ROUNDING_MARGIN`` on
    as a line of the same slope, so that an entry beyond the bound still has a finite gradient."""
    knee = 1 - ROUNDING_MARGIN
    return -torch.log1p(-d.clamp(max=knee)) + torch.relu(d - knee) / ROUNDING_MARGIN


def levels_distance(bits: int) -> Distance:
    """The upload's negative log-likelihood per entry under stochastic rounding of the scaled dummy gradient."""

    def distance(g: list[torch.Tensor], t: list[torch.Tensor]) -> torch.Tensor:
        s = _scale(g, t)
        total: torch.Tensor | float = 0
        entries = 0
        for x, target in zip(g, t):
            flat, tflat = x.flatten(1), target.flatten(1)
            _, _, step = level_grid(tflat, bits)
            d = (_per_job(s, flat) * flat - tflat).abs() / step.clamp_min(EPS)
            total = total + torch.where(step > 0, rounding_nll(d), 0).sum(1)
            entries += flat.shape[1]
        return cast(torch.Tensor, total) / entries  # a tensor: the update has layers

    return distance


def radius_distance(epsilon: float, relative: bool) -> Distance:
    """Zero inside the ball the defense's radius allows around the upload, squared excess outside."""

    def distance(g: list[torch.Tensor], t: list[torch.Tensor]) -> torch.Tensor:
        norm_t = torch.sqrt(dot(t, t))
        radius = epsilon * norm_t / max(1 - epsilon, EPS) if relative else torch.full_like(norm_t, epsilon)
        gap = torch.sqrt(l2_distance(g, t) + EPS)
        return torch.relu(gap - radius) ** 2 / (norm_t**2).clamp_min(EPS)

    return distance


def orthogonal_distance(g: list[torch.Tensor], t: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor: squared cosine to the upload plus the squared relative norm mismatch, averaged over tensors."""
    total: torch.Tensor | float = 0
    for x, target in zip(g, t):
        flat, tflat = x.flatten(1), target.flatten(1)
        norm_x, norm_t = flat.norm(dim=1), tflat.norm(dim=1).clamp_min(EPS)
        cos = (flat * tflat).sum(1) / (norm_x * norm_t + EPS)
        total = total + cos**2 + (norm_x / norm_t - 1) ** 2
    return cast(torch.Tensor, total) / len(g)  # a tensor: the update has layers


def orthogonal_or_raw_distance(g: list[torch.Tensor], t: list[torch.Tensor]) -> torch.Tensor:
    """The smaller of ``orthogonal_distance`` and the cosine distance: CENSOR with its raw fallback."""
    return torch.minimum(orthogonal_distance(g, t), cosine_distance(g, t))


def clipped_distance(clip: float) -> Distance:
    """Squared distance of the clipped dummy update to the upload, relative to the upload's squared norm."""

    def distance(g: list[torch.Tensor], t: list[torch.Tensor]) -> torch.Tensor:
        return l2_distance(clip_per_job(g, clip), t) / dot(t, t).clamp_min(EPS)

    return distance


def cosine_then_likelihood(bits: int) -> Distance:
    """``1 - cos(g, t)`` plus ``LIKELIHOOD_WEIGHT`` times the rounding likelihood (``levels_distance``)."""
    likelihood = levels_distance(bits)

    def distance(g: list[torch.Tensor], t: list[torch.Tensor]) -> torch.Tensor:
        return cosine_distance(g, t) + LIKELIHOOD_WEIGHT * likelihood(g, t)

    return distance


def aware_phases(
    revealed: Revealed, band_weight: float = 1.0, rounding_likelihood: bool = False
) -> tuple[tuple[float, Distance], ...]:
    """The distances the attack minimizes in turn, each from a fraction of the iterations on (the first from 0).

    For quantized levels the cosine: it already matches the unbiased upload, and the rounding's likelihood did
    not beat it (at 4 bits it lowered SSIM at every start and weight tried; at 8 bits it gained on some tiles and
    lost on others: ``docs/explanation/defenses.md``). With ``rounding_likelihood`` the cosine plus the
    likelihood from ``LIKELIHOOD_START`` on (``cosine_then_likelihood``), refining where the cosine brought the
    search. Otherwise ``aware_distance`` throughout, a sent band's penalty weighted by ``band_weight``."""
    if isinstance(revealed, QuantizedLevels):
        if not rounding_likelihood:
            return ((0.0, cosine_distance),)
        return ((0.0, cosine_distance), (LIKELIHOOD_START, cosine_then_likelihood(revealed.bits)))
    return ((0.0, aware_distance(revealed, band_weight)),)


def aware_distance(revealed: Revealed, band_weight: float = 1.0) -> Distance:
    """The distance an attacker who knows what the upload ``revealed`` minimizes."""
    match revealed:
        case Unchanged() | Undeclared() | AlteredLayer():
            return cosine_distance
        case SentBand(drops_top=drops_top):
            return band_distance(drops_top, band_weight)
        case QuantizedLevels(bits=bits):
            return levels_distance(bits)
        case TowardsRobustData():
            return cosine_distance
        case WithinRadius(epsilon=epsilon, relative=relative):
            return radius_distance(epsilon, relative)
        case OrthogonalPerTensor(raw_fallback=False):
            return orthogonal_distance
        case OrthogonalPerTensor():
            return orthogonal_or_raw_distance
        case ClippedNoise(clip=clip):
            return clipped_distance(clip)
    raise ValueError(f"no defense-aware distance for {type(revealed).__name__}")
