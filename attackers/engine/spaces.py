"""What an optimization attack searches over, and how a point of it becomes dummy images (and labels).

Every space lays the jobs (uploads x restarts) on dimension 0 of one tensor
``z``; each job's starting point is drawn from its own seeded generator
(``attackers.jobs.job_seed``), so it is the same alone or batched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ImageShape = tuple[int, int, int]


class PixelSpace:
    """Dummy images themselves, z (J, B, C, H, W), started uniform in [0, 1] and boxed to it."""

    def __init__(self, batch: int, shape: ImageShape) -> None:
        self.batch, self.shape = batch, shape

    def start(self, generator: torch.Generator) -> torch.Tensor:
        """One job's starting point."""
        return torch.rand((self.batch, *self.shape), generator=generator)

    def images(self, z: torch.Tensor) -> torch.Tensor:
        """(J, B, C, H, W) images of ``z``."""
        return z

    def soft_labels(self, z: torch.Tensor) -> torch.Tensor | None:
        """Label distributions (J, B, classes) searched with the images, or None."""
        return None

    def project_(self, z: torch.Tensor) -> None:
        """Clamp ``z`` in place to the pixel box [0, 1]."""
        z.clamp_(0, 1)

    def final_images(self, z: torch.Tensor) -> torch.Tensor:
        """The images a job ends with, finite and in [0, 1]."""
        return torch.nan_to_num(self.images(z), nan=0.5).clamp(0, 1)


class JointSpace(PixelSpace):
    """Dummy images and label logits searched together (DLG), z (J, B*C*H*W + B*classes) flat, both started
    uniform in [0, 1]; the labels are the softmax of the logits."""

    def __init__(self, batch: int, shape: ImageShape, classes: int) -> None:
        super().__init__(batch, shape)
        self.classes = classes
        self.pixels = batch * shape[0] * shape[1] * shape[2]

    def start(self, generator: torch.Generator) -> torch.Tensor:
        return torch.rand(self.pixels + self.batch * self.classes, generator=generator)

    def images(self, z: torch.Tensor) -> torch.Tensor:
        return z[:, : self.pixels].reshape(-1, self.batch, *self.shape)

    def soft_labels(self, z: torch.Tensor) -> torch.Tensor:
        return torch.softmax(z[:, self.pixels :].reshape(-1, self.batch, self.classes), dim=-1)

    def project_(self, z: torch.Tensor) -> None:
        z[:, : self.pixels].clamp_(0, 1)

    def final_labels(self, z: torch.Tensor) -> torch.Tensor:
        """(J, B) int64: each image's most likely class."""
        return torch.nan_to_num(self.soft_labels(z)).argmax(-1)


@dataclass
class LatentSpace:
    """Latents of a trained generator, z (J, B, latent_dim), started standard normal; images ``decoder(z)``."""

    batch: int
    latent_dim: int
    decoder: Callable[[torch.Tensor], torch.Tensor]
    shape: ImageShape

    def start(self, generator: torch.Generator) -> torch.Tensor:
        return torch.randn((self.batch, self.latent_dim), generator=generator)

    def images(self, z: torch.Tensor) -> torch.Tensor:
        return self.decoder(z.flatten(0, 1)).reshape(-1, self.batch, *self.shape)

    def soft_labels(self, z: torch.Tensor) -> torch.Tensor | None:
        return None

    def project_(self, z: torch.Tensor) -> None:
        """Latents are not boxed."""

    def final_images(self, z: torch.Tensor) -> torch.Tensor:
        return self.images(z)


Space = PixelSpace | LatentSpace
