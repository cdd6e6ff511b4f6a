"""How many samples a dataset's train and test splits hold, known without loading it, and how many training
samples a partition needs.

Datasets with an official split have fixed sizes. Those split here (``from_arrays``: ``test_fraction`` of every
class is held out, rounded) are sized from their class counts, the same arithmetic the split does; the photo
tiles from the photos' fixed pixel sizes. An image folder's size is its folder's: it is not listed, and is
known only once it is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedguard.data.offline import PHOTO_SCALES
from fedguard.data.registry import SourceOptions

OFFICIAL_SPLITS: dict[str, tuple[int, int]] = {
    "mnist": (60_000, 10_000),
    "fashion-mnist": (60_000, 10_000),
    "cifar10": (50_000, 10_000),
    "cifar100": (50_000, 10_000),
    "svhn": (73_257, 26_032),
}
CLASS_COUNTS: dict[str, tuple[int, ...]] = {
    "mnist-5k": (500,) * 10,
    "digits": (178, 182, 177, 183, 181, 182, 181, 179, 174, 180),
    "lfw-faces": (100, 100),
}
# (height, width) of each source photo of the 'photos' dataset, in its class order
PHOTO_SHAPES: tuple[tuple[int, int], ...] = (
    (512, 512),
    (300, 451),
    (400, 600),
    (427, 640),
    (872, 1000),
    (512, 512),
    (1411, 1411),
    (500, 741),
    (427, 640),
    (427, 640),
)
# The Dirichlet partitioner's smallest partition is min(10, N // (2 * clients)) samples: 0, and clients may get
# nothing, below 2 samples per client.
SAMPLES_PER_CLIENT = {"dirichlet": 2}


@dataclass(frozen=True)
class SplitSizes:
    """Samples in the ``train`` and ``test`` splits, and the ``data.*`` keys besides ``data.name`` that set them."""

    train: int
    test: int
    depends_on: tuple[str, ...]


def split_sizes(name: str, options: SourceOptions) -> SplitSizes | None:
    """The split sizes of dataset ``name`` loaded with ``options``; None when only loading it tells."""
    if name in OFFICIAL_SPLITS:
        return SplitSizes(*OFFICIAL_SPLITS[name], ())
    if name in CLASS_COUNTS:
        return _held_out(CLASS_COUNTS[name], options.test_fraction, ("data.test-fraction",))
    if name == "photos":
        tiles = tuple(photo_tiles(height, width, options.image_size) for height, width in PHOTO_SHAPES)
        return _held_out(tiles, options.test_fraction, ("data.test-fraction", "data.image-size"))
    return None


def train_class_counts(name: str, options: SourceOptions) -> tuple[int, ...] | None:
    """Training samples of each class of dataset ``name`` loaded with ``options`` (a partition's sizes follow from
    them and the seed alone); None when only loading it tells."""
    if name in CLASS_COUNTS:
        counts = CLASS_COUNTS[name]
    elif name == "photos":
        counts = tuple(photo_tiles(height, width, options.image_size) for height, width in PHOTO_SHAPES)
    else:
        return None
    return tuple(count - round(count * options.test_fraction) for count in counts)


def photo_tiles(height: int, width: int, size: int) -> int:
    """Tiles of ``size`` pixels cut from one photo at every scale (as ``offline.tile_photo`` cuts them)."""
    tiles = 0
    for short_side in PHOTO_SCALES:
        if short_side < size:
            continue
        scale = short_side / min(height, width)
        tiles += (round(height * scale) // size) * (round(width * scale) // size)
    return tiles


def samples_needed(scheme: str, clients: int) -> int:
    """Training samples partition ``scheme`` needs to give each of ``clients`` clients some."""
    return SAMPLES_PER_CLIENT.get(scheme, 1) * clients


def _held_out(counts: tuple[int, ...], test_fraction: float, depends_on: tuple[str, ...]) -> SplitSizes:
    """Sizes after holding out ``test_fraction`` of each class, rounded (as ``dataset.stratified_split``)."""
    test = [round(count * test_fraction) for count in counts]
    return SplitSizes(sum(counts) - sum(test), sum(test), depends_on)
