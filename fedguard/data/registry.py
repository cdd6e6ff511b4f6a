"""The dataset registry, each dataset's static spec, and the per-process dataset cache."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from fedguard.data.dataset import ImageData
from fedguard.data.spec import DataSpec
from fedguard.registry import NoParams, Registry


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
SpecOf = Callable[[SourceOptions], DataSpec | None]

DATASETS: Registry[DatasetLoader] = Registry("dataset")


def unknown_spec(options: SourceOptions) -> None:
    """The ``spec`` of a dataset whose shape only its data tell (e.g. the classes of an image folder)."""
    return None


ROOTED: set[str] = set()
"""The datasets that load from ``data.root`` only (registered with ``needs_root``)."""


def register_dataset(
    name: str, *, spec: SpecOf = unknown_spec, needs_root: bool = False
) -> Callable[[DatasetLoader], DatasetLoader]:
    """Register the decorated loader under ``name``; ``spec(options)`` is the shape of its samples, known without
    loading them (None: only the data tell); ``needs_root``: it loads from ``data.root`` only, so that a run
    without one is refused when it is configured."""
    if needs_root:
        ROOTED.add(name)
    return DATASETS.register(name, NoParams, spec)


def fixed_spec(channels: int, height: int, width: int, num_classes: int) -> SpecOf:
    """The ``spec`` of a dataset whose shape does not depend on the options."""
    return lambda options: DataSpec(channels, height, width, num_classes)


def dataset_spec(name: str, options: SourceOptions = SourceOptions()) -> DataSpec | None:
    """The spec ``load_dataset(name, options).spec`` will have, without loading anything (None: unknown before
    loading)."""
    return DATASETS.traits(name, options)


class DatasetNotFoundError(FileNotFoundError):
    """A local dataset is missing; the message says where we looked and how to get it."""


@functools.lru_cache(maxsize=4)
def load_dataset(name: str, options: SourceOptions = SourceOptions()) -> ImageData:
    """The dataset ``name``, loaded once per process."""
    return DATASETS.get(name).factory(options)
