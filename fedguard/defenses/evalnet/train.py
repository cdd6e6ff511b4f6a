"""Training the evaluation network as a noise-ratio regressor, deterministically given a seed.

Refiner (Fan et al., Sec 3.3 and Appendix D) trains D on interpolations of
natural images and uniform noise labelled with the noise ratio:
``((1 - r) * t1 + r * t2, r)`` with ``t1`` a natural image, ``t2`` i.i.d.
U(0, 1) pixels and ``r ~ U(0, 1)``, one ratio per image. The paper does not
name the loss; it is the mean squared error between D's output and ``r``
(regression of the ratio; binary cross-entropy against the soft target ``r``
would suit the sigmoid output as well). Appendix D mixes each minibatch
with noise 11 times (ratios 0, 0.1, ..., 1) before moving on; here each
minibatch takes ``mixes`` Adam steps, each with fresh ratios drawn from
U(0, 1) (as Sec 3.3 states) and fresh noise. The paper trains the 128-wide
network on TinyImageNet for 20 epochs with Adam at 1e-4 and batches of 128; it
does not ship offline, so the defaults here train a narrower network on the
small public splits that do (photo tiles, MNIST digits) with a larger step, in
well under a minute on two CPU cores.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedguard.data import SourceOptions
from fedguard.data.spec import DataSpec
from fedguard.defenses.evalnet.model import EvalNet
from fedguard.defenses.evalnet.store import TrainedEvalNet
from fedguard.trained.fitting import EpochStats, check_options, public_images


@dataclass(frozen=True)
class EvalNetOptions:
    """Epochs, minibatch size, Adam step, channel width of D, noise mixes (Adam steps) per minibatch, seed."""

    epochs: int = 20
    batch_size: int = 32
    lr: float = 1e-3
    width: int = 16
    mixes: int = 11
    seed: int = 0

    def __post_init__(self) -> None:
        check_options(self, ("epochs", "batch_size", "width", "mixes"))


def blend(images: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(1 - r) * images + r * noise`` with ``r ~ U(0, 1)`` per image and U(0, 1) noise per pixel; and ``r`` (N,)."""
    ratios = torch.rand(len(images), generator=generator)
    noise = torch.rand(images.shape, generator=generator)
    r = ratios.reshape(-1, 1, 1, 1)
    return (1 - r) * images + r * noise, ratios


def train_regressor(
    images: torch.Tensor, spec: DataSpec, options: EvalNetOptions, progress: Callable[[EpochStats], None] | None = None
) -> tuple[EvalNet, list[float]]:
    """Train D on noise blends of ``images`` (N, C, H, W) in [0, 1] on the CPU; D and each epoch's mean loss."""
    if images.shape[1:] != spec.shape:
        raise ValueError(f"images of shape {tuple(images.shape[1:])} do not match the spec's {spec.shape}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(options.seed)
        net = EvalNet(spec, options.width)
    generator = torch.Generator().manual_seed(options.seed)
    optimizer = torch.optim.Adam(net.parameters(), lr=options.lr)
    losses = []
    for epoch in range(1, options.epochs + 1):
        start, total, count = time.perf_counter(), torch.zeros(()), 0
        for batch in torch.randperm(len(images), generator=generator).split(options.batch_size):
            for _ in range(options.mixes):
                mixed, ratios = blend(images[batch], generator)
                loss = F.mse_loss(net(mixed), ratios)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                total += loss.detach() * len(batch)
                count += len(batch)
        losses.append(float(total) / count)
        if progress is not None:
            progress(EpochStats(epoch, options.epochs, losses[-1], time.perf_counter() - start, "ratio mse"))
    return net.eval().requires_grad_(False), losses


def train_evalnet(
    dataset: str,
    split: str = "test",
    options: EvalNetOptions = EvalNetOptions(),
    source: SourceOptions = SourceOptions(),
    progress: Callable[[EpochStats], None] | None = None,
) -> TrainedEvalNet:
    """Train D on every image of ``split`` ('test': held out from the clients, or 'train') of ``dataset``."""
    images, spec = public_images(dataset, split, source)
    net, losses = train_regressor(images, spec, options, progress)
    return TrainedEvalNet(net, dataset, split, tuple(losses))
