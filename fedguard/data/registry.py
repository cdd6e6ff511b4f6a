"""The dataset registry and the per-process dataset cache."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from fedguard.data.dataset import ImageData
from fedguard.registry import Registry


@dataclass(frozen=True)
class SourceOptions:
    """How to load a dataset.

    ``root``: local folder for datasets that do not ship with the packages ('' = none);
    ``download``: let torchvision fetch a missing dataset (needs the network);
    ``test_fraction``: held-out share for datasets without an official test split;
    ``image_size``: side in pixels for sources that resize (photos, image folders).
    """

    root: str = ""
    download: bool = False
    test_fraction: float = 0.2
    image_size: int = 32


DatasetLoader = Callable[[SourceOptions], ImageData]

DATASETS: Registry[DatasetLoader] = Registry("dataset")
register_dataset = DATASETS.register


class DatasetNotFoundError(FileNotFoundError):
    """A local dataset is missing; the message says where we looked and how to get it."""


@functools.lru_cache(maxsize=4)
def load_dataset(name: str, options: SourceOptions = SourceOptions()) -> ImageData:
    """The dataset ``name``, loaded once per process."""
    return DATASETS.get(name).factory(options)
