"""Builders shared by the tests: configs, clients and Flower result objects."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

from clients import DefendedClient
from fedguard.config import Config, load_config
from fedguard.data.local import DEBIAN_FASHION_MNIST

FASHION_MNIST = (DEBIAN_FASHION_MNIST / "t10k-images-idx3-ubyte.gz").is_file()
needs_fashion_mnist = pytest.mark.skipif(
    not FASHION_MNIST, reason="Debian package dataset-fashion-mnist not installed (.ci/run installs it where apt-get may)")


def config(*overrides: str) -> Config:
    """A small config on scikit-learn digits with an MLP, plus ``key=value`` overrides."""
    return load_config(None, ["data.name=digits", "model.name=mlp", "model.mlp.hidden=16", "partition.num-clients=4",
                              "train.clients-per-round=3", "train.batch-size=8", *overrides])


def context(partition_id: int, num_partitions: int) -> Context:
    """A SuperNode context as Flower's simulation builds it."""
    return Context(
        run_id=1,
        node_id=100 + partition_id,
        node_config={"partition-id": partition_id, "num-partitions": num_partitions},
        state=RecordDict(),
        run_config={},
    )


def fit_res(arrays: list[np.ndarray], num_examples: int, metrics: dict[str, Any]) -> FitRes:
    """A successful FitRes carrying ``arrays``."""
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), num_examples, metrics)


def client_fit(cfg: Config, client: int, arrays: list[np.ndarray], round_: int, state: RecordDict | None = None):
    """(upload, num_examples, metrics) of one client's fit."""
    return DefendedClient(cfg, client, state if state is not None else RecordDict()).fit(arrays, {"round": round_})
