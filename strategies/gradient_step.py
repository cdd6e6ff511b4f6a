"""Lets a strategy that aggregates models (Flower's FedAvg, FedAdam, Krum, ...) run FedSGD.

Each gradient upload ``g_i`` becomes the model one local SGD step would reach,
``theta - lr * g_i`` (buffers are taken as uploaded), before the wrapped
strategy sees it. Flower's FedAvg then takes the step
``theta - lr * sum_i w_i g_i`` (``w_i``: the share of examples), FedMedian the
coordinate-wise median step, Krum the step of the upload it selects, FedAdam
an Adam step on the pseudo-gradient ``-lr * mean(g)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedguard.wire.records import ARRAYS, array_record
from strategies.wrapper import StrategyWrapper


class GradientStep(StrategyWrapper):
    """Turn gradient uploads into stepped models, then aggregate as ``strategy`` does.

    Parameters
    ----------
    strategy : Strategy
        A strategy that aggregates model uploads.
    lr : float
        The SGD step (> 0) applied to each gradient.
    trainable : Sequence[bool]
        For each model array, True for a parameter (stepped), False for a buffer (taken as uploaded).
    """

    def __init__(self, strategy: Strategy, lr: float, trainable: Sequence[bool]) -> None:
        super().__init__(strategy)
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        self.lr = lr
        self.trainable = list(trainable)
        self._current: dict[int, ArrayRecord] = {}

    def __repr__(self) -> str:
        return f"GradientStep({self.strategy!r}, lr={self.lr})"

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._current = {server_round: arrays}
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Step each gradient upload from the global model, then aggregate as ``strategy`` does."""
        replies = list(replies)
        current = self._current.pop(server_round)
        names, theta = list(current.keys()), current.to_numpy_ndarrays()
        for reply in replies:
            if reply.has_error() or not isinstance(reply.content.get(ARRAYS), ArrayRecord):
                continue
            grads = cast(ArrayRecord, reply.content[ARRAYS]).to_numpy_ndarrays()
            if len(grads) != len(theta):
                raise ValueError(
                    f"node {reply.metadata.src_node_id} uploaded {len(grads)} arrays, the model has {len(theta)}"
                )
            stepped = [
                (t - self.lr * g).astype(t.dtype) if is_param else g
                for t, g, is_param in zip(theta, grads, self.trainable)
            ]
            reply.content[ARRAYS] = array_record(names, stepped)
        return self.strategy.aggregate_train(server_round, replies)
