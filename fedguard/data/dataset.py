"""In-memory image datasets: uint8 tensors, converted to float on access."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedguard.data.spec import DataSpec


@dataclass(frozen=True)
class Split:
    """``images``: uint8 (N, C, H, W); ``labels``: int64 (N,)."""

    images: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise ValueError(f"images must be uint8 (N, C, H, W), got {self.images.dtype} {tuple(self.images.shape)}")
        if self.labels.shape != (self.images.shape[0],):
            raise ValueError(f"labels must have shape ({self.images.shape[0]},), got {tuple(self.labels.shape)}")

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def batch(self, indices: np.ndarray | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Float images in [0, 1] (B, C, H, W) and int64 labels (B,) at ``indices`` (all if None)."""
        if indices is None:
            return self.images.float().div_(255.0), self.labels.clone()
        index = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return self.images[index].float().div_(255.0), self.labels[index]


@dataclass(frozen=True)
class ImageData:
    """A dataset: its name, sample shape, class names and train/test splits."""

    name: str
    spec: DataSpec
    classes: tuple[str, ...]
    train: Split
    test: Split


def to_uint8_nchw(array: np.ndarray) -> torch.Tensor:
    """(N, H, W) or (N, H, W, C) uint8/float-in-[0,1] array -> uint8 tensor (N, C, H, W)."""
    if array.dtype != np.uint8:
        array = np.clip(np.rint(np.asarray(array, dtype=np.float64) * 255.0), 0, 255).astype(np.uint8)
    if array.ndim == 3:
        array = array[:, None]
    elif array.ndim == 4:
        array = array.transpose(0, 3, 1, 2)
    else:
        raise ValueError(f"expected (N, H, W) or (N, H, W, C), got shape {array.shape}")
    return torch.from_numpy(np.ascontiguousarray(array))


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices with ``test_fraction`` of every class in the test part.

    Seeded independently of the run seed so the held-out set is the same for
    every run on a dataset.
    """
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        n_test = round(len(members) * test_fraction)
        test.append(members[:n_test])
        train.append(members[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def from_arrays(
    name: str, images: np.ndarray, labels: np.ndarray, classes: tuple[str, ...], test_fraction: float
) -> ImageData:
    """An ``ImageData`` from one pool of samples, split into train and test by class."""
    tensor = to_uint8_nchw(images)
    labels = np.asarray(labels, dtype=np.int64)
    train_idx, test_idx = stratified_split(labels, test_fraction)
    label_tensor = torch.from_numpy(labels)
    spec = DataSpec(int(tensor.shape[1]), int(tensor.shape[2]), int(tensor.shape[3]), len(classes))
    return ImageData(
        name,
        spec,
        classes,
        Split(tensor[train_idx], label_tensor[train_idx]),
        Split(tensor[test_idx], label_tensor[test_idx]),
    )
