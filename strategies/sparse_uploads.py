"""A wrapper that restores coordinate-encoded uploads before anything else on the server sees them.

A client whose defended upload is mostly zeros (gradient pruning) sends it coordinate-encoded
(``fedguard.wire.sparse``) and declares ``encoding = "sparse"``. This wrapper decodes those uploads to dense
arrays, keyed as the global model, and hands every reply on to the wrapped strategy (capture and
aggregation see the dense upload, exactly what the client's defense produced). Clients declare the bytes
they sent (``upload-bytes``) and the dense size (``dense-bytes``) either way.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from fedguard.wire.records import densify
from strategies.wrapper import StrategyWrapper


class SparseUploads(StrategyWrapper):
    """Decode coordinate-encoded uploads, then do exactly what ``strategy`` does."""

    _names: tuple[str, ...] = ()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._names = tuple(arrays.keys())
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode the sparse uploads, then aggregate as ``strategy`` does."""
        replies = list(replies)
        for reply in replies:
            if not reply.has_error():
                densify(reply, self._names)
        return self.strategy.aggregate_train(server_round, replies)
