"""Update-level differential privacy: clip the whole update, then add noise.

The update (all parameter tensors together) is scaled down to L2 norm at most
``clip``; then every entry gets independent noise of scale ``noise_multiplier
* clip``: Gaussian with that standard deviation, or Laplace with that scale b
(standard deviation sqrt(2) * b). This is the client-side mechanism of
DP-FedAvg / DP-FedSGD (one upload = one release); DP-SGD, which clips every
sample's gradient, is a separate defense.

Privacy. Two clipped updates differ by at most 2 * clip in L2, the sensitivity
of one upload when one client's data may change arbitrarily (the paper's
Delta s = 2C/m with m = 1, Mjölnir Eq. 6). With ``epsilon`` > 0 the Gaussian
noise is calibrated to (``epsilon``, ``delta``) for that sensitivity with the
exact analytic Gaussian mechanism (``gaussian_mechanism``; valid for every
epsilon), replacing ``noise_multiplier``. For Gaussian noise the defense reports
each client's epsilon spent at ``delta`` over all its uploads so far (exact
composition of Gaussian mechanisms). Laplace noise gets no epsilon: an L2 clip
bounds its L1 sensitivity only by sqrt(d) * 2 * clip.

Calibration. ``calibration = "analytic"`` (default) is the exact calibration
above. ``"mjolnir-code"`` is the noise of Mjölnir's published code (Liu et al.,
AAAI 2025), so that epsilon is in that paper's noise units: a per-entry std of
``0.02 * sqrt(2 ln(1.25 / delta)) / epsilon`` in gradient units, whatever the
clip (0.02 = 2 * lr * C / m with the code's lr 1e-3, C 10, m 1; 0.0869 / epsilon
at the code's delta 1e-4, 0.0969 / epsilon at the paper's 1e-5). Epsilon is then
only a noise unit: the report gives the epsilon that std really spends for the
clip (as for ``noise_multiplier``), not the configured one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch

from fedguard.defenses.base import LocalStep, class_traits, register_defense
from fedguard.defenses.gaussian_mechanism import epsilon_after, gaussian_sigma
from fedguard.defenses.revealed import ClippedNoise
from fedguard.limits import MAX_NOISE_STD

MECHANISMS = ("gaussian", "laplace")
CALIBRATIONS = ("analytic", "mjolnir-code")
MJOLNIR_CODE_SENSITIVITY = 0.02  # 2 * lr * C / m of Mjölnir's published code: lr 1e-3, C 10, m 1 (gradient units)
SENSITIVITY_IN_CLIPS = 2.0  # L2 distance of two updates clipped to `clip`, in units of `clip`
RELEASES = "releases"  # key of the defense state: uploads this client has made


@dataclass(frozen=True)
class UpdateDPParams:
    """``clip``: L2 bound of the update; ``noise_multiplier``: noise scale / clip; ``mechanism``: gaussian | laplace;
    ``epsilon``: > 0 calibrates the Gaussian noise to (epsilon, ``delta``) instead of ``noise_multiplier``
    (0: off); ``delta``: of the calibration and of the reported epsilon; ``calibration``: how epsilon sets the
    noise, 'analytic' (the exact mechanism for sensitivity 2 * clip) or 'mjolnir-code' (Mjölnir's published
    code: std 0.02 * sqrt(2 ln(1.25 / delta)) / epsilon, whatever the clip)."""

    clip: float = 1.0
    noise_multiplier: float = 0.1
    mechanism: str = "gaussian"
    epsilon: float = 0.0
    delta: float = 1e-5
    calibration: str = "analytic"

    def __post_init__(self) -> None:
        if not self.clip > 0:
            raise ValueError(f"clip must be > 0, got {self.clip}")
        if self.noise_multiplier < 0:
            raise ValueError(f"noise-multiplier must be >= 0, got {self.noise_multiplier}")
        if not (math.isfinite(self.clip) and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"clip and noise-multiplier must be finite, got {self.clip} and {self.noise_multiplier}")
        if self.mechanism not in MECHANISMS:
            raise ValueError(f"mechanism {self.mechanism!r}: choose one of {', '.join(MECHANISMS)}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {self.delta}")
        if not (self.epsilon >= 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"epsilon must be finite and >= 0 (0: use noise-multiplier), got {self.epsilon}")
        if self.epsilon > 0 and self.mechanism != "gaussian":
            raise ValueError(
                f"epsilon calibrates the gaussian mechanism only, not {self.mechanism!r}: "
                "set noise-multiplier for Laplace noise"
            )
        if self.epsilon > 0 and self.noise_multiplier != UpdateDPParams.noise_multiplier:
            raise ValueError(f"give noise-multiplier ({self.noise_multiplier}) or epsilon ({self.epsilon}), not both")
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"calibration {self.calibration!r}: choose one of {', '.join(CALIBRATIONS)}")
        if self.calibration == "mjolnir-code" and self.epsilon == 0:
            raise ValueError("calibration 'mjolnir-code' maps epsilon to a noise std: set epsilon > 0")
        if not self.noise_scale < MAX_NOISE_STD:
            raise ValueError(
                f"the noise scale (clip * noise-multiplier, or as epsilon calibrates it) is {self.noise_scale:g}: "
                f"must be < {MAX_NOISE_STD:g} (fedguard.limits.MAX_NOISE_STD: float32 uploads would hold infinities)"
            )

    @property
    def effective_noise_multiplier(self) -> float:
        """Noise scale / clip: calibrated to (epsilon, delta) when epsilon > 0, else ``noise_multiplier``."""
        if self.calibration == "mjolnir-code":
            return mjolnir_code_sigma(self.epsilon, self.delta) / self.clip
        if self.epsilon > 0:
            return gaussian_sigma(self.epsilon, self.delta, SENSITIVITY_IN_CLIPS)
        return self.noise_multiplier

    @property
    def noise_scale(self) -> float:
        """Gaussian standard deviation, or Laplace scale b, of the noise on each entry (gradient units)."""
        if self.calibration == "mjolnir-code":
            return mjolnir_code_sigma(self.epsilon, self.delta)
        return self.effective_noise_multiplier * self.clip


def mjolnir_code_sigma(epsilon: float, delta: float) -> float:
    """Per-entry Gaussian std (gradient units) of Mjölnir's published code at (``epsilon``, ``delta``):
    ``0.02 * sqrt(2 ln(1.25 / delta)) / epsilon``, the classical calibration for its sensitivity 0.02."""
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be finite and > 0, got {epsilon}")
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return MJOLNIR_CODE_SENSITIVITY * math.sqrt(2 * math.log(1.25 / delta)) / epsilon


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all entries of ``tensors`` together, accumulated in float64 (a 0-d float64 tensor: squares of
    float32 entries below 1e-19 would fall into float32's subnormal range and lose digits)."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors]))


def clip_by_global_norm(tensors: list[torch.Tensor], clip: float) -> list[torch.Tensor]:
    """``tensors * min(1, clip / ||tensors||)``, each in its own dtype."""
    factor = torch.clamp(clip / (global_norm(tensors) + 1e-12), max=1.0)
    return [t * factor.to(t.dtype) for t in tensors]


def clip_per_job(grads: list[torch.Tensor], clip: float) -> list[torch.Tensor]:
    """Each job of (J, ...) updates scaled by ``min(1, clip / ||job||)``, its tensors' norms taken together;
    differentiable in ``grads``."""
    squares = cast(torch.Tensor, sum(g.flatten(1).pow(2).sum(1) for g in grads))  # a tensor: there are gradients
    norm = torch.sqrt(squares)
    factor = torch.clamp(clip / (norm + 1e-12), max=1.0)
    return [g * factor.reshape(-1, *[1] * (g.dim() - 1)) for g in grads]


class UpdateDP:
    """Clip the update to ``clip`` in L2, add Gaussian or Laplace noise of scale ``noise_multiplier * clip``."""

    update_only = True  # reads only the update: a Flower mod applies it (fedguard.flower)

    def __init__(self, params: UpdateDPParams) -> None:
        self.params = params
        self.noise_multiplier = params.effective_noise_multiplier
        self.noise_scale = params.noise_scale  # Gaussian std, or Laplace scale b, on each entry

    def __call__(self, step: LocalStep, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        clipped = clip_by_global_norm([g.detach() for g in step.grads], self.params.clip)
        state[RELEASES] = torch.tensor(int(state[RELEASES]) + 1 if RELEASES in state else 1, dtype=torch.int64)
        return [t + self.noise(t, step.generator) for t in clipped]

    def report(self, state: dict[str, torch.Tensor]) -> dict[str, float]:
        """{'epsilon', 'delta'} this client has spent over its uploads, Gaussian noise only (nothing for Laplace
        noise or without noise: no finite epsilon). Under 'mjolnir-code' it is what the noise std really spends for
        sensitivity 2 * clip, not the configured epsilon."""
        if self.params.mechanism != "gaussian" or self.noise_multiplier == 0:
            return {}
        releases = int(state[RELEASES]) if RELEASES in state else 0
        spent = epsilon_after(releases, self.noise_multiplier, SENSITIVITY_IN_CLIPS, self.params.delta)
        return {"epsilon": spent, "delta": self.params.delta}

    def noise(self, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Noise of the configured mechanism and scale, shaped, typed and placed like ``like``."""
        scale = self.noise_scale
        if scale == 0:
            return torch.zeros_like(like)
        options: dict[str, Any] = {"generator": generator, "dtype": like.dtype, "device": generator.device}
        if self.params.mechanism == "gaussian":
            noise = torch.randn(like.shape, **options) * scale
        else:
            uniform = torch.rand(like.shape, **options) - 0.5
            noise = -scale * torch.sign(uniform) * torch.log1p(-2 * uniform.abs().clamp(max=0.5 - 1e-7))
        return noise.to(like.device)

    def revealed(self) -> ClippedNoise:
        """The update clipped to ``clip``, plus zero-mean noise of std ``noise_scale`` (Gaussian) or
        ``sqrt(2) noise_scale`` (Laplace of scale ``noise_scale``) on every entry."""
        laplace = self.params.mechanism == "laplace"
        return ClippedNoise(self.params.clip, self.noise_scale * (math.sqrt(2) if laplace else 1.0))

    def simulate(self, grads: list[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
        """Per job of (J, ...) updates: clip all tensors together to ``clip``, then add fresh noise."""
        return [g + self.noise(g, generator) for g in clip_per_job(grads, self.params.clip)]


@register_defense("dp", params=UpdateDPParams, traits=class_traits(UpdateDP))
def build_update_dp(params: UpdateDPParams) -> UpdateDP:
    """Update-level DP: L2 clipping and Gaussian or Laplace noise."""
    return UpdateDP(params)
