"""Dataset sources: the offline ones load real data; the local loaders read files in the real formats."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedguard.data import DATASETS, DatasetNotFoundError, SourceOptions, load_dataset
from fedguard.data.dataset import stratified_split
from fedguard.data.local import FASHION_FILES, stage_debian_fashion_mnist


def uncached(name: str, options: SourceOptions = SourceOptions()):
    return DATASETS.get(name).factory(options)


@pytest.mark.parametrize(
    ("name", "shape", "classes", "total"),
    [
        ("mnist-5k", (1, 28, 28), 10, 5000),
        ("digits", (1, 8, 8), 10, 1797),
        ("lfw-faces", (1, 25, 25), 2, 200),
        ("photos", (3, 32, 32), 10, 1086),
    ],
)
def test_offline_sources(name: str, shape: tuple, classes: int, total: int) -> None:
    data = load_dataset(name)
    assert data.spec.shape == shape and data.spec.num_classes == classes
    assert len(data.train) + len(data.test) == total
    assert abs(len(data.test) / total - 0.2) < 0.02
    x, _y = data.train.batch(np.arange(5))
    assert x.dtype == torch.float32 and float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    assert set(np.unique(data.train.labels.numpy())) == set(range(classes))
    assert float(data.train.images.float().std()) > 10, "images should not be blank"


def test_mnist_5k_is_balanced_real_digits() -> None:
    data = load_dataset("mnist-5k")
    counts = np.bincount(data.test.labels.numpy())
    assert (counts == 100).all()
    # Real strokes: most pixels are background, a real share is ink.
    ink = (data.train.images > 128).float().mean()
    assert 0.05 < float(ink) < 0.3


def test_photos_tiles_differ_between_sources() -> None:
    data = load_dataset("photos")
    means = [data.train.images[data.train.labels == c].float().mean((0, 2, 3)) for c in range(10)]
    assert len({tuple(m.round().tolist()) for m in means}) == 10


def test_photos_image_size_option() -> None:
    data = uncached("photos", SourceOptions(image_size=16))
    assert data.spec.shape == (3, 16, 16)


def test_stratified_split_is_fixed_and_disjoint() -> None:
    labels = np.repeat(np.arange(4), 25)
    train, test = stratified_split(labels, 0.2)
    again_train, again_test = stratified_split(labels, 0.2)
    assert (train == again_train).all() and (test == again_test).all()
    assert not set(train) & set(test) and len(train) + len(test) == 100
    assert (np.bincount(labels[test]) == 5).all()


# ---------- local loaders on files the tests write in the real on-disk formats ----------


def write_idx(folder: Path, stem: str, images: np.ndarray, labels: np.ndarray, gz: bool = False) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    n, rows, cols = images.shape
    image_bytes = struct.pack(">IIII", 2051, n, rows, cols) + images.astype(np.uint8).tobytes()
    label_bytes = struct.pack(">II", 2049, n) + labels.astype(np.uint8).tobytes()
    opener = gzip.open if gz else open
    suffix = ".gz" if gz else ""
    with opener(folder / f"{stem}-images-idx3-ubyte{suffix}", "wb") as handle:
        handle.write(image_bytes)
    with opener(folder / f"{stem}-labels-idx1-ubyte{suffix}", "wb") as handle:
        handle.write(label_bytes)


def random_digits(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), np.arange(n) % 10


@pytest.mark.parametrize(("name", "folder"), [("mnist", "MNIST"), ("fashion-mnist", "FashionMNIST")])
def test_mnist_family_from_root(tmp_path: Path, name: str, folder: str) -> None:
    train_x, train_y = random_digits(30, 0)
    test_x, test_y = random_digits(20, 1)
    write_idx(tmp_path / folder / "raw", "train", train_x, train_y)
    write_idx(tmp_path / folder / "raw", "t10k", test_x, test_y)
    data = uncached(name, SourceOptions(root=str(tmp_path)))
    assert data.spec.shape == (1, 28, 28) and data.spec.num_classes == 10
    assert torch.equal(data.train.images[:, 0], torch.from_numpy(train_x))
    assert torch.equal(data.test.labels, torch.from_numpy(test_y))


def test_fashion_mnist_from_debian_layout(tmp_path: Path) -> None:
    source = tmp_path / "usr-share-datasets"
    train_x, train_y = random_digits(10, 2)
    write_idx(source, "train", train_x, train_y, gz=True)
    write_idx(source, "t10k", train_x[:5], train_y[:5], gz=True)
    root = stage_debian_fashion_mnist(source, tmp_path / "cache")
    assert root is not None
    assert sorted(p.name for p in (root / "FashionMNIST" / "raw").iterdir()) == sorted(FASHION_FILES)
    assert stage_debian_fashion_mnist(tmp_path / "absent", tmp_path / "cache") is None


def test_fashion_mnist_without_any_copy_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("fedguard.data.local.DEBIAN_FASHION_MNIST", tmp_path / "nothing")
    with pytest.raises(DatasetNotFoundError, match="apt-get install dataset-fashion-mnist"):
        uncached("fashion-mnist")


def exists_ignoring_md5(path: str, md5: str | None = None) -> bool:
    return Path(path).is_file()


def write_cifar(root: Path, hundred: bool) -> np.ndarray:
    rng = np.random.default_rng(3)
    label_key = "fine_labels" if hundred else "labels"
    classes = 100 if hundred else 10

    def dump(path: Path, n: int) -> np.ndarray:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        with open(path, "wb") as handle:
            pickle.dump({"data": data, label_key: list(np.arange(n) % classes)}, handle)
        return data

    if hundred:
        folder = root / "cifar-100-python"
        folder.mkdir(parents=True)
        first = dump(folder / "train", 12)
        dump(folder / "test", 6)
        with open(folder / "meta", "wb") as handle:
            pickle.dump({"fine_label_names": [f"c{i}" for i in range(100)]}, handle)
        return first
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    first = dump(folder / "data_batch_1", 4)
    for i in range(2, 6):
        dump(folder / f"data_batch_{i}", 4)
    dump(folder / "test_batch", 6)
    with open(folder / "batches.meta", "wb") as handle:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, handle)
    return first


@pytest.mark.parametrize("hundred", [False, True])
def test_cifar_from_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hundred: bool) -> None:
    # Only the md5 comparison with torchvision's published files is skipped: these are small stand-ins.
    monkeypatch.setattr("torchvision.datasets.cifar.check_integrity", exists_ignoring_md5)
    first = write_cifar(tmp_path, hundred)
    data = uncached("cifar100" if hundred else "cifar10", SourceOptions(root=str(tmp_path)))
    assert data.spec.shape == (3, 32, 32) and data.spec.num_classes == (100 if hundred else 10)
    assert len(data.train) == (12 if hundred else 20) and len(data.test) == 6
    assert torch.equal(data.train.images[0], torch.from_numpy(first[0].reshape(3, 32, 32)))


def test_svhn_from_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import scipy.io

    monkeypatch.setattr("torchvision.datasets.svhn.check_integrity", exists_ignoring_md5)
    rng = np.random.default_rng(4)
    for split, n in (("train", 8), ("test", 4)):
        x = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
        y = (np.arange(n) % 10 + 1).reshape(n, 1)  # SVHN stores digit 0 as label 10
        scipy.io.savemat(tmp_path / f"{split}_32x32.mat", {"X": x, "y": y})
    data = uncached("svhn", SourceOptions(root=str(tmp_path)))
    assert data.spec.shape == (3, 32, 32) and len(data.train) == 8 and len(data.test) == 4
    assert data.train.labels.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert data.test.labels.tolist() == [1, 2, 3, 4]


def write_images(folder: Path, classes: list[str], per_class: int) -> None:
    rng = np.random.default_rng(5)
    for name in classes:
        (folder / name).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(folder / name / f"{i}.png")


def test_imagefolder_single_tree(tmp_path: Path) -> None:
    write_images(tmp_path, ["cat", "dog"], 10)
    data = uncached("imagefolder", SourceOptions(root=str(tmp_path), image_size=16))
    assert data.classes == ("cat", "dog") and data.spec.shape == (3, 16, 16)
    assert len(data.train) == 16 and len(data.test) == 4


def test_imagefolder_train_test(tmp_path: Path) -> None:
    write_images(tmp_path / "train", ["a", "b", "c"], 3)
    write_images(tmp_path / "test", ["a", "b", "c"], 1)
    data = uncached("imagefolder", SourceOptions(root=str(tmp_path)))
    assert (len(data.train), len(data.test), data.spec.num_classes) == (9, 3, 3)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("cifar10", "cifar-10-batches-py"),
        ("cifar100", "cifar-100-python"),
        ("svhn", "train_32x32.mat"),
        ("mnist", "MNIST/raw"),
    ],
)
def test_missing_local_dataset_says_where_it_looked(tmp_path: Path, name: str, expected: str) -> None:
    with pytest.raises(DatasetNotFoundError) as caught:
        uncached(name, SourceOptions(root=str(tmp_path)))
    assert str(tmp_path) in str(caught.value) and expected in str(caught.value)
    assert "data.download=true" in str(caught.value)


@pytest.mark.parametrize("name", ["cifar10", "mnist", "svhn", "imagefolder"])
def test_local_dataset_without_root(name: str) -> None:
    with pytest.raises(DatasetNotFoundError, match="data.root"):
        uncached(name)


def test_unknown_dataset_lists_choices() -> None:
    with pytest.raises(ValueError, match="mnist-5k"):
        load_dataset("imagenet")


@pytest.mark.skipif(
    not Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz").is_file(),
    reason="Debian package dataset-fashion-mnist not installed (.ci/run installs it where apt-get may)",
)
def test_real_fashion_mnist_from_debian() -> None:
    data = uncached("fashion-mnist")
    assert (len(data.train), len(data.test)) == (60000, 10000)
    assert data.classes[0] == "T-shirt/top" and data.spec.shape == (1, 28, 28)
