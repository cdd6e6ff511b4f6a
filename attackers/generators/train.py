"""Training the generator as the decoder of a VAE, deterministically given a seed.

Why a VAE decoder rather than GGL's GAN (Li et al., CVPR 2022): the attack
only needs a decoder from a standard-normal latent to images, and a VAE gives
one with a stable objective that trains in minutes on a CPU, with no
discriminator to balance. Loss: the negative ELBO per image in nats, a
Bernoulli likelihood (binary cross-entropy summed over pixels, in [0, 1]) plus
KL(q(z | x) || N(0, I)).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attackers.generators.model import Decoder, Encoder
from attackers.generators.store import TrainedGenerator
from fedguard.data import SourceOptions
from fedguard.data.spec import DataSpec
from fedguard.trained.fitting import EpochStats, check_options, public_images


@dataclass(frozen=True)
class TrainOptions:
    """Epochs, minibatch size, Adam step, latent dimension, channel width of the networks, seed."""

    epochs: int = 30
    batch_size: int = 64
    lr: float = 2e-3
    latent_dim: int = 16
    width: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        check_options(self, ("epochs", "batch_size", "latent_dim", "width"))


def negative_elbo(encoder: Encoder, decoder: Decoder, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Summed negative ELBO (nats) of images ``x`` (N, C, H, W), one reparameterized sample each."""
    mean, log_var = encoder(x)
    noise = torch.randn(mean.shape, generator=generator)
    z = mean + torch.exp(0.5 * log_var) * noise
    reconstruction = F.binary_cross_entropy_with_logits(decoder.logits(z), x, reduction="sum")
    kl = 0.5 * (mean**2 + log_var.exp() - 1 - log_var).sum()
    return reconstruction + kl


def train_vae(
    images: torch.Tensor, spec: DataSpec, options: TrainOptions, progress: Callable[[EpochStats], None] | None = None
) -> tuple[Decoder, list[float]]:
    """Train a VAE on ``images`` (N, C, H, W) in [0, 1] on the CPU; the decoder and each epoch's mean loss."""
    if images.shape[1:] != spec.shape:
        raise ValueError(f"images of shape {tuple(images.shape[1:])} do not match the spec's {spec.shape}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(options.seed)
        encoder = Encoder(spec, options.latent_dim, options.width)
        decoder = Decoder(spec, options.latent_dim, options.width)
    generator = torch.Generator().manual_seed(options.seed)
    optimizer = torch.optim.Adam([*encoder.parameters(), *decoder.parameters()], lr=options.lr)
    losses = []
    for epoch in range(1, options.epochs + 1):
        start, total = time.perf_counter(), torch.zeros(())
        for batch in torch.randperm(len(images), generator=generator).split(options.batch_size):
            loss = negative_elbo(encoder, decoder, images[batch], generator)
            optimizer.zero_grad()
            (loss / len(batch)).backward()
            optimizer.step()
            total += loss.detach()
        losses.append(float(total) / len(images))
        if progress is not None:
            progress(
                EpochStats(epoch, options.epochs, losses[-1], time.perf_counter() - start, digits=2, unit=" nats/image")
            )
    return decoder.eval().requires_grad_(False), losses


def train_generator(
    dataset: str,
    split: str = "test",
    options: TrainOptions = TrainOptions(),
    source: SourceOptions = SourceOptions(),
    progress: Callable[[EpochStats], None] | None = None,
) -> TrainedGenerator:
    """Train a generator on every image of ``split`` ('test': held out from the clients, or 'train') of ``dataset``."""
    images, spec = public_images(dataset, split, source)
    decoder, losses = train_vae(images, spec, options, progress)
    return TrainedGenerator(decoder, dataset, split, tuple(losses))
