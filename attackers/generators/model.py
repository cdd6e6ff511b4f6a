"""The VAE's encoder and decoder, sized by a ``DataSpec``; the decoder is the generator G: z -> image.

Two stride-2 convolutions down, two stride-2 transposed convolutions up. The
decoder works on a grid of ``ceil(H / 4) x ceil(W / 4)`` and crops its output
to H x W, so any image side of at least 4 pixels works. No normalization
layers: every image depends on its own latent only.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from fedguard.data.spec import DataSpec

MIN_SIDE = 4


def check_spec(spec: DataSpec) -> None:
    """Raises ``ValueError`` for images smaller than ``MIN_SIDE`` pixels a side."""
    if min(spec.height, spec.width) < MIN_SIDE:
        raise ValueError(f"images of {spec.height}x{spec.width} pixels: the generator needs sides >= {MIN_SIDE}")


class Encoder(nn.Module):
    """Images (N, C, H, W) in [0, 1] -> mean and log-variance (N, latent_dim) of q(z | x)."""

    def __init__(self, spec: DataSpec, latent_dim: int, width: int) -> None:
        super().__init__()
        check_spec(spec)
        features = 2 * width * (spec.height // 4) * (spec.width // 4)
        self.net = nn.Sequential(
            nn.Conv2d(spec.channels, width, 4, 2, 1),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 4, 2, 1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(features, 2 * latent_dim),
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_var = self.net(x).chunk(2, dim=1)
        return mean, log_var


class Decoder(nn.Module):
    """The generator: latents (N, latent_dim) -> images (N, C, H, W) in [0, 1] (``logits`` before the sigmoid)."""

    def __init__(self, spec: DataSpec, latent_dim: int, width: int) -> None:
        super().__init__()
        check_spec(spec)
        self.spec, self.latent_dim, self.width = spec, latent_dim, width
        grid = (math.ceil(spec.height / 4), math.ceil(spec.width / 4))
        self.net = nn.Sequential(
            nn.Linear(latent_dim, 2 * width * grid[0] * grid[1]),
            nn.ReLU(),
            nn.Unflatten(1, (2 * width, *grid)),
            nn.ConvTranspose2d(2 * width, width, 4, 2, 1),
            nn.ReLU(),
            nn.ConvTranspose2d(width, spec.channels, 4, 2, 1),
        )

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """Pre-sigmoid images (N, C, H, W)."""
        return self.net(z)[..., : self.spec.height, : self.spec.width]

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(z))
