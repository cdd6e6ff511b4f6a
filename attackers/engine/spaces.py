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

    def dummy_batch(
        self, z: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The batch the dummy update is computed on: images (J, n, C, H, W), their ``labels`` and per-image loss
        weights (J, n) summing to 1 (None: the batch mean). Here ``images(z)`` with the labels as given."""
        return self.images(z), labels, None

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


class RobustMixtureSpace(PixelSpace):
    """Refiner's upload explained (``fedguard.defenses.revealed.TowardsRobustData``): the B images x and the B
    robust images x* searched together with the robust share ``c``, z (J, 2*B*C*H*W + 1) flat: x, x*, then
    ``w`` with ``c = max_share * sigmoid(w)``. The dummy update is the gradient of the 2B images with loss
    weights (1 - c) / B for x and c / B for x*, each with its own image's label; the reconstruction is x, the
    priors see x only. Pixels start uniform in [0, 1], ``c`` at ``max_share / 2``."""

    def __init__(self, batch: int, shape: ImageShape, max_share: float) -> None:
        super().__init__(batch, shape)
        self.pixels = batch * shape[0] * shape[1] * shape[2]
        self.max_share = max_share

    def start(self, generator: torch.Generator) -> torch.Tensor:
        return torch.cat([torch.rand(2 * self.pixels, generator=generator), torch.zeros(1)])

    def images(self, z: torch.Tensor) -> torch.Tensor:
        return z[:, : self.pixels].reshape(-1, self.batch, *self.shape)

    def robust_images(self, z: torch.Tensor) -> torch.Tensor:
        """(J, B, C, H, W) the robust images x*."""
        return z[:, self.pixels : 2 * self.pixels].reshape(-1, self.batch, *self.shape)

    def robust_share(self, z: torch.Tensor) -> torch.Tensor:
        """(J,) the share ``c`` of the robust images' gradient in the upload."""
        return self.max_share * torch.sigmoid(z[:, -1])

    def dummy_batch(self, z: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        share = self.robust_share(z)[:, None].expand(-1, self.batch) / self.batch
        weights = torch.cat([1 / self.batch - share, share], dim=1)
        images = torch.cat([self.images(z), self.robust_images(z)], dim=1)
        return images, torch.cat([labels, labels], dim=1), weights

    def project_(self, z: torch.Tensor) -> None:
        z[:, : 2 * self.pixels].clamp_(0, 1)


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

    def dummy_batch(
        self, z: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``images(z)`` with the labels as given, weighted as the batch mean."""
        return self.images(z), labels, None

    def project_(self, z: torch.Tensor) -> None:
        """Latents are not boxed."""

    def final_images(self, z: torch.Tensor) -> torch.Tensor:
        return self.images(z)


Space = PixelSpace | LatentSpace
