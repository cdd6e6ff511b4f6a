"""FedSGD: every selected client uploads the gradient of one local batch.

The server averages the uploads uniformly (the setting of the gradient-leakage
papers) and takes one SGD step: ``theta <- theta - lr * mean(g)``. Upload
entries that are buffers (BatchNorm running statistics) are averaged and
replace the global ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedguard.wire.records import Upload, array_record, read_upload


class FedSGD(FedAvg):
    """Federated SGD with a uniform average of client gradients, on Flower's message API.

    Parameters
    ----------
    lr : float
        Server learning rate (> 0).
    trainable : Sequence[bool]
        For each array of the model, True if it is a trainable parameter
        (updated by SGD) and False if it is a buffer (averaged).
    **kwargs
        Passed on to Flower's ``FedAvg`` (node sampling, record keys).
    """

    def __init__(self, *, lr: float, trainable: Sequence[bool], **kwargs: Any) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not trainable:
            raise ValueError("trainable must list at least one array")
        super().__init__(**kwargs)
        self.lr = lr
        self.trainable = list(trainable)
        self._current: dict[int, ArrayRecord] = {}

    def __repr__(self) -> str:
        return f"FedSGD(lr={self.lr})"

    def aggregation(self) -> str:
        """How the uploads are combined: the uniform mean of the gradients, then the server's step."""
        return f"the uniform mean of the gradients, then theta -= {self.lr:g} * mean; buffers averaged"

    def summary(self) -> None:
        """Flower's sampling lines, then the uniform mean (Flower's FedAvg would say it weighs by examples)."""
        log(INFO, "\t├──> Sampling: fraction train %.2f, evaluate %.2f", self.fraction_train, self.fraction_evaluate)
        log(INFO, "\t└──> Aggregation: %s", self.aggregation())

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Remember the global model, then sample nodes as FedAvg does."""
        self._current = {server_round: arrays}
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """One SGD step on the uniform mean of the uploaded gradients (in client order, so that a run
        repeats bit for bit)."""
        # Flower's check wants the same array keys in every reply; a pruned upload travels coordinate-encoded
        # (read_upload decodes it), so each upload's arrays are checked as it is read instead.
        valid, _ = self._check_and_log_replies(list(replies), is_train=True, validate=False)
        if not valid:
            return None, None
        current = self._current.pop(server_round, None)
        if current is None:
            raise RuntimeError(f"aggregate_train of round {server_round} without configure_train")
        names, arrays = list(current.keys()), current.to_numpy_ndarrays()
        order = sorted(valid, key=lambda m: client_order(read_upload(m, arrays=False)))
        sums: list[np.ndarray] = []
        for reply in order:  # one upload's arrays at a time: memory does not grow with the clients
            upload = read_upload(reply)
            if len(upload.arrays) != len(self.trainable):
                raise ValueError(
                    f"node {upload.node} uploaded {len(upload.arrays)} arrays, the model has {len(self.trainable)}"
                )
            if not sums:  # float16 adds in float32, as numpy's mean does
                sums = [a.astype(np.float32) if a.dtype == np.float16 else a.copy() for a in upload.arrays]
            else:
                sums = [np.add(s, a, out=s) for s, a in zip(sums, upload.arrays)]
        updated = [
            fedsgd_step(now, total / len(order), self.lr, is_param)
            for now, total, is_param in zip(arrays, sums, self.trainable)
        ]
        metrics = self.train_metrics_aggr_fn([m.content for m in valid], self.weighted_by_key)
        return array_record(names, updated), metrics


def client_order(upload: Upload) -> tuple[bool, int, int]:
    """Sort key of uploads: by client, then node."""
    return (upload.client is None, upload.client or 0, upload.node)


def fedsgd_step(current: np.ndarray, mean: np.ndarray, lr: float, is_param: bool) -> np.ndarray:
    """``current - lr * mean`` for a parameter; ``mean`` for a buffer."""
    if is_param:
        return (current - lr * mean).astype(current.dtype)
    if np.issubdtype(current.dtype, np.integer):
        return np.rint(mean).astype(current.dtype)
    return mean.astype(current.dtype)
