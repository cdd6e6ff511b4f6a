"""Splitting a training set among clients: IID, Dirichlet(alpha), k classes per client.

Partitions are index arrays into the training split, computed from the labels
and a seed only, so every process that asks gets the same answer. The
Dirichlet and k-classes schemes are flwr-datasets' partitioners.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from fedguard.registry import Registry


@dataclass(frozen=True)
class PartitionOptions:
    """``alpha``: Dirichlet concentration (small = skewed); ``classes_per_client``: for 'classes'."""

    alpha: float = 0.5
    classes_per_client: int = 2


Partitioner = Callable[[np.ndarray, int, PartitionOptions, int], list[np.ndarray]]

PARTITIONERS: Registry[Partitioner] = Registry("partition")
register_partitioner = PARTITIONERS.register


def partition(labels: np.ndarray, num_clients: int, scheme: str, options: PartitionOptions, seed: int) -> list[np.ndarray]:
    """Sorted index arrays, one per client, covering disjoint parts of ``labels``."""
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients > len(labels):
        raise ValueError(f"cannot split {len(labels)} samples among {num_clients} clients")
    parts = PARTITIONERS.get(scheme).factory(np.asarray(labels), num_clients, options, seed)
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _label_table(labels: np.ndarray):  # -> datasets.Dataset
    from datasets import Dataset

    return Dataset.from_dict({"label": labels.tolist(), "index": np.arange(len(labels)).tolist()})


def _indices(partitioner, num_clients: int) -> list[np.ndarray]:
    return [np.asarray(partitioner.load_partition(i)["index"]) for i in range(num_clients)]


@register_partitioner("iid")
def iid(labels: np.ndarray, num_clients: int, options: PartitionOptions, seed: int) -> list[np.ndarray]:
    """Uniformly shuffled, equal-size shards."""
    order = np.random.default_rng(seed).permutation(len(labels))
    return np.array_split(order, num_clients)


@register_partitioner("dirichlet")
def dirichlet(labels: np.ndarray, num_clients: int, options: PartitionOptions, seed: int) -> list[np.ndarray]:
    """Per class, client shares drawn from Dirichlet(alpha) (flwr-datasets DirichletPartitioner)."""
    from flwr_datasets.partitioner import DirichletPartitioner

    min_size = min(10, len(labels) // (2 * num_clients))
    partitioner = DirichletPartitioner(
        num_partitions=num_clients, partition_by="label", alpha=options.alpha, min_partition_size=min_size, seed=seed
    )
    partitioner.dataset = _label_table(labels)
    return _indices(partitioner, num_clients)


@register_partitioner("classes")
def classes(labels: np.ndarray, num_clients: int, options: PartitionOptions, seed: int) -> list[np.ndarray]:
    """Each client holds ``classes_per_client`` classes (flwr-datasets PathologicalPartitioner)."""
    from flwr_datasets.partitioner import PathologicalPartitioner

    num_classes = len(np.unique(labels))
    if not 1 <= options.classes_per_client <= num_classes:
        raise ValueError(
            f"partition.classes-per-client must be in [1, {num_classes}] for this dataset, "
            f"got {options.classes_per_client}"
        )
    partitioner = PathologicalPartitioner(
        num_partitions=num_clients,
        partition_by="label",
        num_classes_per_partition=options.classes_per_client,
        class_assignment_mode="first-deterministic",
        seed=seed,
    )
    partitioner.dataset = _label_table(labels)
    return _indices(partitioner, num_clients)
