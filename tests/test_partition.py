"""Partitioners: disjoint, covering, seeded, and shaped as their scheme says."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedguard.data import load_dataset
from fedguard.data.federated import client_split
from fedguard.data.partition import PARTITIONERS, PartitionOptions, partition

LABELS = np.repeat(np.arange(10), 60)


def check_disjoint(parts: list[np.ndarray], total: int, covering: bool = True) -> None:
    joined = np.concatenate(parts)
    assert len(joined) == len(set(joined.tolist())), "a sample is in two partitions"
    assert joined.min() >= 0 and joined.max() < total
    if covering:
        assert len(joined) == total


@pytest.mark.parametrize("scheme", PARTITIONERS.names())
def test_seeded_and_disjoint(scheme: str) -> None:
    parts = partition(LABELS, 8, scheme, PartitionOptions(), seed=1)
    again = partition(LABELS, 8, scheme, PartitionOptions(), seed=1)
    assert len(parts) == 8 and all((a == b).all() for a, b in zip(parts, again))
    check_disjoint(parts, len(LABELS), covering=scheme != "classes")
    other = partition(LABELS, 8, scheme, PartitionOptions(), seed=2)
    assert any(len(a) != len(b) or (a != b).any() for a, b in zip(parts, other))


@given(n=st.integers(20, 300), clients=st.integers(1, 20), seed=st.integers(0, 2**31))
@settings(max_examples=50, deadline=None)
def test_iid_sizes_differ_by_at_most_one(n: int, clients: int, seed: int) -> None:
    parts = partition(np.arange(n) % 7, clients, "iid", PartitionOptions(), seed)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    check_disjoint(parts, n)


def test_classes_per_client() -> None:
    parts = partition(LABELS, 10, "classes", PartitionOptions(classes_per_client=2), seed=0)
    for part in parts:
        assert len(np.unique(LABELS[part])) <= 2
    assert sum(len(p) for p in parts) == len(LABELS)


def test_dirichlet_small_alpha_skews_labels() -> None:
    def mean_classes(alpha: float) -> float:
        parts = partition(LABELS, 10, "dirichlet", PartitionOptions(alpha=alpha), seed=0)
        return float(np.mean([len(np.unique(LABELS[p])) for p in parts]))

    assert mean_classes(0.1) < mean_classes(100.0)
    assert mean_classes(100.0) == 10


@pytest.mark.parametrize("scheme", ["iid", "dirichlet"])
def test_max_per_client_cuts_each_share_to_a_seeded_subset_of_itself(scheme: str) -> None:
    full = partition(LABELS, 8, scheme, PartitionOptions(), seed=3)
    capped = partition(LABELS, 8, scheme, PartitionOptions(max_per_client=20), seed=3)
    assert [len(c) for c in capped] == [min(len(f), 20) for f in full]
    assert all(set(c.tolist()) <= set(f.tolist()) for c, f in zip(capped, full))
    assert all(
        (a == b).all()
        for a, b in zip(capped, partition(LABELS, 8, scheme, PartitionOptions(max_per_client=20), seed=3))
    )
    other = partition(LABELS, 8, scheme, PartitionOptions(max_per_client=20), seed=4)
    assert any(len(a) != len(b) or (a != b).any() for a, b in zip(capped, other))
    check_disjoint(capped, len(LABELS), covering=False)


def test_dirichlet_draws_again_without_warning_until_every_client_holds_its_minimum() -> None:
    # Seed 0's first draw over 25 clients leaves one with 5 samples, under the minimum of 10.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parts = partition(LABELS, 25, "dirichlet", PartitionOptions(), seed=0)
    assert min(len(p) for p in parts) >= 10
    check_disjoint(parts, len(LABELS))
    with pytest.raises(ValueError, match="partition.alpha = 0.01 over 60 clients"):
        partition(LABELS, 60, "dirichlet", PartitionOptions(alpha=0.01), seed=0)


@pytest.mark.parametrize("kind", ["dirichlet", "classes"])
def test_the_partitioners_lists_read_as_indices_equal_the_partitions_it_selects(kind: str) -> None:
    from flwr_datasets.partitioner import DirichletPartitioner, PathologicalPartitioner

    from fedguard.data.partition import _indices, _label_table

    def partitioner() -> object:
        if kind == "dirichlet":
            made = DirichletPartitioner(12, "label", alpha=0.5, min_partition_size=0, seed=3)
        else:
            made = PathologicalPartitioner(12, "label", num_classes_per_partition=2, seed=3)
        made.dataset = _label_table(LABELS[::-1].copy())  # labels out of order: the indices are not sorted by class
        return made

    read, selecting = _indices(partitioner(), 12), partitioner()
    selected = [np.asarray(selecting.load_partition(i)["index"]) for i in range(12)]
    assert [p.tolist() for p in read] == [p.tolist() for p in selected]
    assert sum(len(p) for p in read) > 0


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="classes-per-client"):
        partition(LABELS, 4, "classes", PartitionOptions(classes_per_client=11), seed=0)
    with pytest.raises(ValueError, match="among 700 clients"):
        partition(LABELS, 700, "iid", PartitionOptions(), seed=0)
    with pytest.raises(ValueError, match="dirichlet, iid"):
        partition(LABELS, 4, "shards", PartitionOptions(), seed=0)


def test_client_split_matches_partition() -> None:
    from fedguard.data import SourceOptions

    train = load_dataset("digits").train
    parts = partition(train.labels.numpy(), 5, "iid", PartitionOptions(), seed=3)
    split = client_split("digits", SourceOptions(), "iid", PartitionOptions(), 5, 3, client=4)
    assert (split.labels.numpy() == train.labels.numpy()[parts[4]]).all()
    with pytest.raises(ValueError, match="outside"):
        client_split("digits", SourceOptions(), "iid", PartitionOptions(), 5, 3, client=5)
