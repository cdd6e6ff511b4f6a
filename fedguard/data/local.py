"""Datasets read from a local folder with torchvision's own loaders.

Nothing is downloaded unless ``download`` is set. A missing dataset raises
``DatasetNotFoundError`` naming the folder that was searched and how to fill it.
"""

from __future__ import annotations

import gzip
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from fedguard.atomic import replacing
from fedguard.data.dataset import ImageData, Split, from_arrays, to_uint8_nchw
from fedguard.data.registry import DatasetNotFoundError, SourceOptions, fixed_spec, register_dataset, unknown_spec
from fedguard.data.spec import DataSpec

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
FASHION_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def default_cache_root() -> Path:
    """Where unpacked system datasets are kept: ``$FEDGUARD_CACHE`` or ``~/.cache/fedguard``."""
    return Path(os.environ.get("FEDGUARD_CACHE", Path.home() / ".cache" / "fedguard"))


def _require_root(name: str, options: SourceOptions, hint: str) -> Path:
    if not options.root:
        raise DatasetNotFoundError(
            f"dataset {name!r} does not ship with the packages: set data.root to the folder that holds it "
            f"({hint}), or data.download=true with a data.root to let torchvision fetch it (needs the network)"
        )
    return Path(options.root).expanduser()


def _torchvision_split(name: str, options: SourceOptions, expected: str, make: Callable[[Path, bool], Any]) -> Any:
    root = _require_root(name, options, expected)
    try:
        return make(root, options.download)
    except RuntimeError as error:
        raise DatasetNotFoundError(
            f"dataset {name!r} not found under {root} (looked for {root / expected}); "
            f"put it there or set data.download=true (needs the network). torchvision said: {error}"
        ) from error


def _image_data(name: str, classes: tuple[str, ...], train: tuple[Any, Any], test: tuple[Any, Any]) -> ImageData:
    train_images, test_images = to_uint8_nchw(np.asarray(train[0])), to_uint8_nchw(np.asarray(test[0]))
    channels, height, width = train_images.shape[1:]
    spec = DataSpec(channels, height, width, num_classes=len(classes))
    return ImageData(
        name,
        spec,
        classes,
        Split(train_images, torch.as_tensor(np.asarray(train[1]), dtype=torch.long)),
        Split(test_images, torch.as_tensor(np.asarray(test[1]), dtype=torch.long)),
    )


def _mnist_like(name: str, cls: Any, options: SourceOptions, root: Path | None = None) -> ImageData:
    folder = cls.__name__

    def make(base: Path, download: bool) -> tuple[Any, Any]:
        return cls(str(base), train=True, download=download), cls(str(base), train=False, download=download)

    if root is not None:
        train, test = make(root, False)
    else:
        train, test = _torchvision_split(name, options, f"{folder}/raw/train-images-idx3-ubyte", make)
    return _image_data(
        name, tuple(train.classes), (train.data.numpy(), train.targets), (test.data.numpy(), test.targets)
    )


@register_dataset("mnist", spec=fixed_spec(1, 28, 28, 10), needs_root=True)
def load_mnist(options: SourceOptions) -> ImageData:
    """MNIST 60k + 10k, 1x28x28 (torchvision, from data.root)."""
    from torchvision.datasets import MNIST

    return _mnist_like("mnist", MNIST, options)


def stage_debian_fashion_mnist(source: Path | None = None, cache: Path | None = None) -> Path | None:
    """Unpack the Debian ``dataset-fashion-mnist`` files (default ``DEBIAN_FASHION_MNIST``) into a
    torchvision root under ``cache``; None if they are absent."""
    source = DEBIAN_FASHION_MNIST if source is None else source
    if not all((source / f"{f}.gz").is_file() for f in FASHION_FILES):
        return None
    root = cache or default_cache_root()
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for stem in FASHION_FILES:
        target = raw / stem
        if not target.is_file():
            with gzip.open(source / f"{stem}.gz", "rb") as src, replacing(target, sync=False) as dst:
                shutil.copyfileobj(src, dst)
    return root


@register_dataset("fashion-mnist", spec=fixed_spec(1, 28, 28, 10))
def load_fashion_mnist(options: SourceOptions) -> ImageData:
    """Fashion-MNIST 60k + 10k, 1x28x28 (data.root, or Debian's dataset-fashion-mnist)."""
    from torchvision.datasets import FashionMNIST

    if not options.root:
        staged = stage_debian_fashion_mnist()
        if staged is None:
            raise DatasetNotFoundError(
                f"dataset 'fashion-mnist': no data.root set and no Debian copy at {DEBIAN_FASHION_MNIST}; "
                "install it with `apt-get install dataset-fashion-mnist`, or set data.root to a folder holding "
                "FashionMNIST/raw/, or data.download=true with a data.root (needs the network)"
            )
        return _mnist_like("fashion-mnist", FashionMNIST, options, root=staged)
    return _mnist_like("fashion-mnist", FashionMNIST, options)


def _cifar(name: str, cls: Any, folder: str, options: SourceOptions) -> ImageData:
    def make(base: Path, download: bool) -> tuple[Any, Any]:
        return cls(str(base), train=True, download=download), cls(str(base), train=False, download=download)

    train, test = _torchvision_split(name, options, folder, make)
    return _image_data(name, tuple(train.classes), (train.data, train.targets), (test.data, test.targets))


@register_dataset("cifar10", spec=fixed_spec(3, 32, 32, 10), needs_root=True)
def load_cifar10(options: SourceOptions) -> ImageData:
    """CIFAR-10 50k + 10k, 3x32x32 (torchvision, from data.root)."""
    from torchvision.datasets import CIFAR10

    return _cifar("cifar10", CIFAR10, "cifar-10-batches-py", options)


@register_dataset("cifar100", spec=fixed_spec(3, 32, 32, 100), needs_root=True)
def load_cifar100(options: SourceOptions) -> ImageData:
    """CIFAR-100 50k + 10k, 3x32x32 (torchvision, from data.root)."""
    from torchvision.datasets import CIFAR100

    return _cifar("cifar100", CIFAR100, "cifar-100-python", options)


@register_dataset("svhn", spec=fixed_spec(3, 32, 32, 10), needs_root=True)
def load_svhn(options: SourceOptions) -> ImageData:
    """SVHN 73k + 26k, 3x32x32 (torchvision, train_32x32.mat / test_32x32.mat in data.root)."""
    from torchvision.datasets import SVHN

    def make(base: Path, download: bool) -> tuple[Any, Any]:
        return SVHN(str(base), split="train", download=download), SVHN(str(base), split="test", download=download)

    train, test = _torchvision_split("svhn", options, "train_32x32.mat", make)
    classes = tuple(str(d) for d in range(10))
    return _image_data(
        "svhn",
        classes,
        (train.data.transpose(0, 2, 3, 1), train.labels),
        (test.data.transpose(0, 2, 3, 1), test.labels),
    )


def _read_folder(folder: Path, size: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    from torchvision.datasets import ImageFolder

    dataset = ImageFolder(str(folder))

    def load(path: str) -> np.ndarray:
        with Image.open(path) as opened:
            image = opened.convert("RGB")
            side = min(image.size)
            left, top = (image.width - side) // 2, (image.height - side) // 2
            image = image.crop((left, top, left + side, top + side)).resize((size, size), Image.Resampling.BILINEAR)
            return np.asarray(image)

    images = np.stack([load(path) for path, _ in dataset.samples])
    return dataset.classes, images, np.array(dataset.targets)


@register_dataset("imagefolder", spec=unknown_spec, needs_root=True)  # its classes are its folders
def load_image_folder(options: SourceOptions) -> ImageData:
    """Images in class sub-folders of data.root (or of its train/ and test/), center-cropped to image_size."""
    root = _require_root("imagefolder", options, "one sub-folder per class, or train/ and test/ holding them")
    if not root.is_dir():
        raise DatasetNotFoundError(f"dataset 'imagefolder': {root} is not a folder")
    size = options.image_size
    try:
        if (root / "train").is_dir() and (root / "test").is_dir():
            classes, train_x, train_y = _read_folder(root / "train", size)
            test_classes, test_x, test_y = _read_folder(root / "test", size)
            if test_classes != classes:
                raise DatasetNotFoundError(
                    f"{root}/train and {root}/test hold different classes: {classes} vs {test_classes}"
                )
            return _image_data("imagefolder", tuple(classes), (train_x, train_y), (test_x, test_y))
        classes, images, labels = _read_folder(root, size)
    except FileNotFoundError as error:
        if isinstance(error, DatasetNotFoundError):
            raise
        raise DatasetNotFoundError(f"dataset 'imagefolder' under {root}: {error}") from error
    return from_arrays("imagefolder", images, labels, tuple(classes), options.test_fraction)
