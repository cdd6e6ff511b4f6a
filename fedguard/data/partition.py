"""Splitting a training set among clients: IID, Dirichlet(alpha), k classes per client.

Partitions are index arrays into the training split, computed from the labels
and a seed only, so every process that asks gets the same answer. The
Dirichlet and k-classes schemes are flwr-datasets' partitioners.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedguard.registry import Registry


@dataclass(frozen=True)
class PartitionOptions:
    """``alpha``: Dirichlet concentration (small = skewed); ``classes_per_client``: for 'classes';
    ``max_per_client``: most samples a client keeps (0 = all of its share)."""

    alpha: float = 0.5
    classes_per_client: int = 2
    max_per_client: int = 0


Partitioner = Callable[[np.ndarray, int, PartitionOptions, int], list[np.ndarray]]

DIRICHLET_TRIES = 10
PARTITIONERS: Registry[Partitioner] = Registry("partition")
register_partitioner = PARTITIONERS.register


def partition(
    labels: np.ndarray, num_clients: int, scheme: str, options: PartitionOptions, seed: int
) -> list[np.ndarray]:
    """Sorted index arrays, one per client, covering disjoint parts of ``labels``."""
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients > len(labels):
        raise ValueError(f"cannot split {len(labels)} samples among {num_clients} clients")
    parts = PARTITIONERS.get(scheme).factory(np.asarray(labels), num_clients, options, seed)
    parts = [np.asarray(p, dtype=np.int64) for p in parts]
    if options.max_per_client > 0:
        parts = _capped(parts, options.max_per_client, seed)
    return [np.sort(p) for p in parts]


def _capped(parts: list[np.ndarray], most: int, seed: int) -> list[np.ndarray]:
    """Each share cut to a seeded uniform draw of ``most`` of its samples: small local sets (cross-device
    clients) with the scheme's label skew kept in expectation."""
    rng = np.random.default_rng([seed, most])
    return [rng.choice(p, size=most, replace=False) if len(p) > most else p for p in parts]


def _label_table(labels: np.ndarray) -> Any:  # a datasets.Dataset
    from datasets import Dataset

    return Dataset.from_dict({"label": labels.tolist(), "index": np.arange(len(labels)).tolist()})


def _indices(partitioner: Any, num_clients: int) -> list[np.ndarray]:
    """Every partition's indices into the labels. The first ``load_partition`` draws all of them; the rest are
    read from the partitioner's own lists (flwr-datasets 0.6.1, the pinned version) instead of selecting each
    partition's rows of the table, which costs about 7 ms a partition (0.7 s of 0.85 s for 100 clients): the
    table's ``index`` column is ``arange``, so the two are equal (``tests/test_partition.py``)."""
    first = np.asarray(partitioner.load_partition(0)["index"])
    drawn = partitioner._partition_id_to_indices
    return [first, *(np.asarray(drawn[i], dtype=np.int64) for i in range(1, num_clients))]


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
    table = _label_table(labels)
    # Drawn again, at most DIRICHLET_TRIES times, until every client holds min_size samples: the partitioner's own
    # retry warns at each draw it rejects, so each draw here is one call that accepts any sizes.
    for draw_seed in [seed, *np.random.SeedSequence(seed).generate_state(DIRICHLET_TRIES - 1).tolist()]:
        partitioner = DirichletPartitioner(
            num_partitions=num_clients, partition_by="label", alpha=options.alpha, min_partition_size=0, seed=draw_seed
        )
        partitioner.dataset = table
        parts = _indices(partitioner, num_clients)
        if min(len(p) for p in parts) >= min_size:
            return parts
    raise ValueError(
        f"partition.alpha = {options.alpha} over {num_clients} clients left a client with fewer than {min_size} "
        f"samples in {DIRICHLET_TRIES} draws: raise partition.alpha or lower partition.num-clients"
    )


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
