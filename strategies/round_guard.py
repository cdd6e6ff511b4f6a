"""The outermost wrapper of every fedguard server: per-round instructions, reply accounting, dtypes.

- Each round's train ``ConfigRecord`` gets what ``train_config(server_round)`` adds (the ground-truth
  vault of targeted rounds).
- Evaluation is central (the ServerApp scores the global model on the held-out split), so no node is
  asked to evaluate.
- Every round's replies are counted: ``on_replies(server_round, uploads, errors)`` receives the
  successful uploads and the error reasons; a round in which no node succeeded stops the run with
  ``AllClientsFailed`` naming the reasons, instead of carrying on with an unchanged model.
- The aggregate keeps the global model's dtypes (Flower's averaging turns integer buffers into floats).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedguard.records import Upload, array_record, read_upload
from strategies.wrapper import StrategyWrapper


class AllClientsFailed(RuntimeError):
    """No node returned an upload in a round."""


class RoundGuard(StrategyWrapper):
    """Configure, account for and check each round around ``strategy``.

    Parameters
    ----------
    strategy : Strategy
        The wrapped (capturing, aggregating) strategy.
    train_config : Callable[[int], dict[str, Any]]
        Round -> extra entries of that round's train ``ConfigRecord``.
    on_replies : Callable[[int, list[Upload], list[str]], None]
        Called with each round's successful uploads and error reasons, before aggregation.
    """

    def __init__(self, strategy: Strategy, train_config: Callable[[int], dict[str, Any]],
                 on_replies: Callable[[int, list[Upload], list[str]], None]) -> None:
        super().__init__(strategy)
        self.train_config = train_config
        self.on_replies = on_replies
        self._dtypes: list[np.dtype] = []

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._dtypes = [a.dtype for a in arrays.to_numpy_ndarrays()]
        round_config = ConfigRecord({**config, **self.train_config(server_round)})
        return self.strategy.configure_train(server_round, arrays, round_config, grid)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Count the replies, stop when all failed, aggregate as ``strategy`` does, keep the dtypes."""
        replies = list(replies)
        errors = [f"node {m.metadata.src_node_id}: {m.error.reason}" for m in replies if m.has_error()]
        uploads = [read_upload(m) for m in replies if not m.has_error()]
        self.on_replies(server_round, uploads, errors)
        if not uploads:
            reasons = "; ".join(errors[:3]) + (f"; ... ({len(errors) - 3} more)" if len(errors) > 3 else "")
            raise AllClientsFailed(f"round {server_round}: every one of {len(errors)} clients failed "
                                   f"({reasons or 'no node replied'})")
        aggregated, metrics = self.strategy.aggregate_train(server_round, replies)
        if aggregated is None:
            return None, metrics
        arrays = [np.rint(a).astype(d) if np.issubdtype(d, np.integer) and a.dtype != d else a.astype(d, copy=False)
                  for a, d in zip(aggregated.to_numpy_ndarrays(), self._dtypes)]
        return array_record(list(aggregated.keys()), arrays), metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """No node evaluates: the server scores the global model on the held-out split."""
        return []
