"""Update-level differential privacy: clip the whole update, then add noise.

The update (all parameter tensors together) is scaled down to L2 norm at most
``clip``; then every entry gets independent noise of scale ``noise_multiplier
* clip``: Gaussian with that standard deviation, or Laplace with that scale b
(standard deviation sqrt(2) * b). This is the client-side mechanism of
DP-FedAvg / DP-FedSGD (one upload = one release); the privacy accounting of
DP-SGD is a separate defense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedguard.defenses.base import LocalStep, register_defense

MECHANISMS = ("gaussian", "laplace")


@dataclass(frozen=True)
class UpdateDPParams:
    """``clip``: L2 bound of the update; ``noise_multiplier``: noise scale / clip; ``mechanism``: gaussian | laplace."""

    clip: float = 1.0
    noise_multiplier: float = 0.1
    mechanism: str = "gaussian"

    def __post_init__(self) -> None:
        if not self.clip > 0:
            raise ValueError(f"clip must be > 0, got {self.clip}")
        if self.noise_multiplier < 0:
            raise ValueError(f"noise-multiplier must be >= 0, got {self.noise_multiplier}")
        if not (math.isfinite(self.clip) and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"clip and noise-multiplier must be finite, got {self.clip} and {self.noise_multiplier}")
        if self.mechanism not in MECHANISMS:
            raise ValueError(f"mechanism {self.mechanism!r}: choose one of {', '.join(MECHANISMS)}")


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all entries of ``tensors`` together (a 0-d tensor)."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors]))


def clip_by_global_norm(tensors: list[torch.Tensor], clip: float) -> list[torch.Tensor]:
    """``tensors * min(1, clip / ||tensors||)``."""
    factor = torch.clamp(clip / (global_norm(tensors) + 1e-12), max=1.0)
    return [t * factor for t in tensors]


class UpdateDP:
    """Clip the update to ``clip`` in L2, add Gaussian or Laplace noise of scale ``noise_multiplier * clip``."""

    def __init__(self, params: UpdateDPParams) -> None:
        self.params = params

    @property
    def noise_scale(self) -> float:
        """Gaussian standard deviation, or Laplace scale b, of the noise on each entry."""
        return self.params.noise_multiplier * self.params.clip

    def __call__(self, step: LocalStep, state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        clipped = clip_by_global_norm([g.detach() for g in step.grads], self.params.clip)
        return [t + self.noise(t, step.generator) for t in clipped]

    def noise(self, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Noise of the configured mechanism and scale, shaped, typed and placed like ``like``."""
        scale = self.noise_scale
        if scale == 0:
            return torch.zeros_like(like)
        options = {"generator": generator, "dtype": like.dtype, "device": generator.device}
        if self.params.mechanism == "gaussian":
            noise = torch.randn(like.shape, **options) * scale
        else:
            uniform = torch.rand(like.shape, **options) - 0.5
            noise = -scale * torch.sign(uniform) * torch.log1p(-2 * uniform.abs().clamp(max=0.5 - 1e-7))
        return noise.to(like.device)

    def simulate(self, grads: list[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
        """Per job of (J, ...) updates: clip all tensors together to ``clip``, then add fresh noise."""
        norm = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads))
        factor = torch.clamp(self.params.clip / (norm + 1e-12), max=1.0)
        return [g * factor.reshape(-1, *[1] * (g.dim() - 1)) + self.noise(g, generator) for g in grads]


@register_defense("dp", params=UpdateDPParams)
def build_update_dp(params: UpdateDPParams) -> UpdateDP:
    """Update-level DP: L2 clipping and Gaussian or Laplace noise."""
    return UpdateDP(params)
