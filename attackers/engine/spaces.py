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


SINKHORN_ITERATIONS = 20
ASSIGNMENT_SCALE = 10.0
"""Label-assignment logits are ``ASSIGNMENT_SCALE`` times their search variable, so that a signed step of the
pixels' size moves an assignment as far as it moves a pixel."""


def sinkhorn(logits: torch.Tensor, iterations: int = SINKHORN_ITERATIONS) -> torch.Tensor:
    """A nearly doubly stochastic matrix (..., N, N): ``exp(logits)`` with its columns and rows normalized in
    turn, in the log domain, ``iterations`` times each (Sinkhorn-Knopp); the rows last, so that each sums to 1."""
    log_p = logits
    for _ in range(iterations):
        log_p = log_p - torch.logsumexp(log_p, dim=-2, keepdim=True)
        log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)
    return log_p.exp()


class EpochCopiesSpace(PixelSpace):
    """A FedAvg client's examples once per local epoch (Dimitrov et al., TMLR 2022), its shuffle unknown:
    ``epochs`` copies of the N = ``examples`` images, epoch e's minibatches cut in order from copy e, so that
    each copy may hold the examples in that epoch's order. Each copy's labels are the known labels (a multiset
    of N) assigned to its slots by a soft permutation (``sinkhorn`` of searched logits), so every epoch keeps
    the label counts while its minibatches may mix them as the client's did.

    z (J, E*N*C*H*W + E*N*N) flat: the copies' pixels (started uniform in [0, 1], boxed to it), then each
    copy's assignment logits (started at 0: every slot the mean label). An ``epoch-order`` prior ties the
    copies together; the reconstruction is copy 0 with each image averaged with its nearest image in every
    other copy."""

    def __init__(self, epochs: int, examples: int, shape: ImageShape, classes: int) -> None:
        super().__init__(epochs * examples, shape)
        self.epochs, self.examples, self.classes = epochs, examples, classes
        self.pixels = self.batch * shape[0] * shape[1] * shape[2]

    def start(self, generator: torch.Generator) -> torch.Tensor:
        return torch.cat([torch.rand(self.pixels, generator=generator), torch.zeros(self.batch * self.examples)])

    def images(self, z: torch.Tensor) -> torch.Tensor:
        """(J, E*N, C, H, W): every copy, epoch by epoch."""
        return z[:, : self.pixels].reshape(-1, self.batch, *self.shape)

    def assignments(self, z: torch.Tensor) -> torch.Tensor:
        """(J, E, N, N): row i of copy e holds the weights of the known labels at its slot i."""
        logits = ASSIGNMENT_SCALE * z[:, self.pixels :].reshape(-1, self.epochs, self.examples, self.examples)
        return sinkhorn(logits)

    def dummy_batch(self, z: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        """Every copy's images with their slots' label distributions (J, E*N, classes) (``slot_labels``)."""
        return self.images(z), self.slot_labels(z, labels), None

    def slot_labels(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(J, E*N, classes) each slot's label distribution: its copy's assignment applied to the one-hot known
        int64 ``labels`` (J, N)."""
        one_hot = torch.nn.functional.one_hot(labels, self.classes).to(z.dtype)
        return torch.einsum("jeik,jkc->jeic", self.assignments(z), one_hot).flatten(1, 2)

    def project_(self, z: torch.Tensor) -> None:
        z[:, : self.pixels].clamp_(0, 1)

    def final_images(self, z: torch.Tensor) -> torch.Tensor:
        """(J, N, C, H, W): each image of copy 0 averaged with its nearest (squared pixel distance) image in every
        other copy."""
        copies = super().final_images(z).reshape(-1, self.epochs, self.examples, *self.shape)
        first = copies[:, 0]
        total = first.clone()
        for e in range(1, self.epochs):
            nearest = torch.cdist(first.flatten(2), copies[:, e].flatten(2)).argmin(-1)
            total += torch.gather(copies[:, e], 1, nearest[..., None, None, None].expand_as(first))
        return total / self.epochs

    def final_labels(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(J, N) int64: the known label copy 0's assignment weighs most at each slot."""
        return torch.gather(labels, 1, self.assignments(z)[:, 0].argmax(-1))


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
