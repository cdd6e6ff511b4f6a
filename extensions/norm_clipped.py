"""A strategy of one's own, outside the fedguard package: FedAvg that clips each client's model change.

Each upload's change from the global model, ``w_i - w``, is scaled down to an L2 norm of at most ``clip``
before Flower's FedAvg averages the clipped models, so that no client can move the model by more than
``clip`` (a server-side robust aggregation; not a privacy guarantee: nothing is added to the uploads).

Select it from the configuration (the module must be importable: this repository's root is)::

    fedguard run experiments/quickstart.toml --set server.plugins=extensions.norm_clipped \\
        --set server.strategy=norm-clipped-fedavg --set server.norm-clipped-fedavg.clip=0.5
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy

from strategies.registry import StrategyContext, register_strategy


@dataclass(frozen=True)
class NormClipParams:
    """FedAvg of model changes clipped to an L2 norm"""

    clip: float = field(default=1.0, metadata={"help": "largest L2 norm of one client's model change"})

    def __post_init__(self) -> None:
        if not self.clip > 0:
            raise ValueError(f"clip = {self.clip!r}: must be > 0")


class NormClippedFedAvg(FedAvg):
    """Flower's FedAvg on uploads whose change from the global model is clipped to ``clip`` (L2)."""

    def __init__(self, clip: float, **kwargs) -> None:  # kwargs: FedAvg's sampling arguments
        super().__init__(**kwargs)
        self.clip = clip
        self._global: list[np.ndarray] = []

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._global = arrays.to_numpy_ndarrays()
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        clipped = 0
        for reply in replies:
            if reply.has_error():
                continue
            record = reply.content["arrays"]
            upload = record.to_numpy_ndarrays()
            change = [u.astype(np.float64) - g for u, g in zip(upload, self._global)]
            norm = float(np.sqrt(sum(np.sum(c * c) for c in change)))
            if norm > self.clip:
                clipped += 1
                scale = self.clip / norm
                upload = [(g + scale * c).astype(u.dtype) for g, c, u in zip(self._global, change, upload)]
                reply.content["arrays"] = ArrayRecord(
                    array_dict={k: Array(np.asarray(a)) for k, a in zip(record.keys(), upload)}
                )
        print(
            f"norm-clipped-fedavg: round {server_round}: {clipped} of {len(replies)} uploads clipped to {self.clip}",
            flush=True,
        )
        return super().aggregate_train(server_round, replies)


@register_strategy("norm-clipped-fedavg", params=NormClipParams)
def build(context: StrategyContext, params: NormClipParams) -> Strategy:
    """FedAvg of model changes clipped to an L2 norm"""
    return NormClippedFedAvg(params.clip, **context.sampling())
