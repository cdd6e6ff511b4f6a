"""What fedguard's trained networks share as they train (Refiner's evaluation network D, the generator of the
``ggl`` attack, Mjölnir's gradient DDPM and its surrogate): the public split they learn from, the checks of their
options, and the progress line of each finished epoch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedguard.data import SourceOptions, load_dataset
from fedguard.data.spec import DataSpec

SPLITS = ("test", "train")
"""The split a network trains on: 'test' (held out from the clients) or 'train'."""


def check_split(split: str) -> None:
    """Raises ``ValueError`` naming ``split`` unless it is one of ``SPLITS``."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: choose one of {', '.join(SPLITS)}")


def public_images(dataset: str, split: str, source: SourceOptions = SourceOptions()) -> tuple[torch.Tensor, DataSpec]:
    """Every image of ``split`` of ``dataset`` (N, C, H, W) in [0, 1], and the data's spec."""
    check_split(split)
    data = load_dataset(dataset, source)
    images, _ = getattr(data, split).batch()
    return images, data.spec


def check_options(options: Any, counts: tuple[str, ...]) -> None:
    """Raises ``ValueError`` naming the first of ``options``' fields ``counts`` below 1, or an ``lr`` not above 0."""
    for name in counts:
        if getattr(options, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(options, name)}")
    if not options.lr > 0:
        raise ValueError(f"lr must be > 0, got {options.lr}")


@dataclass(frozen=True)
class EpochStats:
    """One finished epoch: its mean ``loss`` (named ``what``, printed with ``digits`` decimals and ``unit``) and
    its wall-clock ``seconds``."""

    epoch: int
    epochs: int
    loss: float
    seconds: float
    what: str = "loss"
    digits: int = 4
    unit: str = ""

    def __str__(self) -> str:
        return (
            f"epoch {self.epoch}/{self.epochs}: {self.what} {self.loss:.{self.digits}f}{self.unit}, "
            f"{self.seconds:.1f} s"
        )


def trained_meta(format_: str, spec: DataSpec, dataset: str, split: str, losses: tuple[float, ...]) -> dict[str, Any]:
    """The meta fields every trained network's file holds: its ``format``, the image ``spec`` ([C, H, W, classes]),
    the ``dataset`` and ``split`` it learnt from, its ``epochs`` and each one's mean loss."""
    return {
        "format": format_,
        "spec": [spec.channels, spec.height, spec.width, spec.num_classes],
        "dataset": dataset,
        "split": split,
        "epochs": len(losses),
        "loss": losses[-1] if losses else None,
        "losses": list(losses),
    }
