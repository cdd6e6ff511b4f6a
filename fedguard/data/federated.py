"""Each client's share of the training data, computed once per process."""

from __future__ import annotations

import functools

import numpy as np

from fedguard.data.dataset import Split
from fedguard.data.partition import PartitionOptions, partition
from fedguard.data.registry import SourceOptions, load_dataset


@functools.lru_cache(maxsize=4)
def partitions(
    dataset: str, options: SourceOptions, scheme: str, scheme_options: PartitionOptions, num_clients: int, seed: int
) -> tuple[np.ndarray, ...]:
    """Index arrays into the training split, one per client (cached per process)."""
    labels = load_dataset(dataset, options).train.labels.numpy()
    return tuple(partition(labels, num_clients, scheme, scheme_options, seed))


def client_split(
    dataset: str,
    options: SourceOptions,
    scheme: str,
    scheme_options: PartitionOptions,
    num_clients: int,
    seed: int,
    client: int,
) -> Split:
    """The training samples held by ``client`` (0 <= client < num_clients)."""
    if not 0 <= client < num_clients:
        raise ValueError(f"client id {client} is outside [0, {num_clients})")
    index = partitions(dataset, options, scheme, scheme_options, num_clients, seed)[client]
    train = load_dataset(dataset, options).train
    return Split(train.images[index], train.labels[index])
