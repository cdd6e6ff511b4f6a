"""A wrapper that restores coordinate-encoded uploads before anything else on the server sees them.

A client whose defended upload is mostly zeros (gradient pruning) sends it coordinate-encoded
(``fedguard.sparse``) and says so with the fit metric ``encoding = "sparse"``. This wrapper, outermost,
decodes those uploads to dense arrays and hands every result on to the wrapped strategy (capture and
aggregation see the dense upload, exactly what the client's defense produced). Clients report the bytes
they sent (``upload-bytes``) and the dense size (``dense-bytes``) either way.
"""

from __future__ import annotations

from flwr.common import (
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from fedguard.sparse import ENCODING_KEY, SPARSE, decode_arrays


def dense_result(res: FitRes) -> FitRes:
    """``res`` with a coordinate-encoded upload decoded (the same object when it is dense already)."""
    if res.metrics.get(ENCODING_KEY) != SPARSE:
        return res
    arrays = decode_arrays(parameters_to_ndarrays(res.parameters))
    metrics = {k: v for k, v in res.metrics.items() if k != ENCODING_KEY}
    return FitRes(res.status, ndarrays_to_parameters(arrays), res.num_examples, metrics)


class SparseUploads(Strategy):
    """Decode coordinate-encoded uploads, then do exactly what ``inner`` does."""

    def __init__(self, inner: Strategy) -> None:
        super().__init__()
        self.inner = inner

    def __repr__(self) -> str:
        return f"SparseUploads({self.inner!r})"

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return self.inner.initialize_parameters(client_manager)

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        return self.inner.configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Decode the sparse uploads, then aggregate as ``inner`` does."""
        return self.inner.aggregate_fit(server_round, [(proxy, dense_result(res)) for proxy, res in results], failures)

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        return self.inner.configure_evaluate(server_round, parameters, client_manager)

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        return self.inner.aggregate_evaluate(server_round, results, failures)

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        return self.inner.evaluate(server_round, parameters)
