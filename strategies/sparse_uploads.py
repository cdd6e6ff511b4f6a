"""A wrapper that restores coordinate-encoded uploads before anything else on the server sees them.

A client whose defended upload is mostly zeros (gradient pruning) sends it coordinate-encoded
(``fedguard.sparse``) and says so with the fit metric ``encoding = "sparse"``. This wrapper, outermost,
decodes those uploads to dense arrays and hands every result on to the wrapped strategy (capture and
aggregation see the dense upload, exactly what the client's defense produced). Clients report the bytes
they sent (``upload-bytes``) and the dense size (``dense-bytes``) either way.
"""

from __future__ import annotations

from flwr.common import FitRes, Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_proxy import ClientProxy

from fedguard.sparse import ENCODING_KEY, SPARSE, decode_arrays
from strategies.delegating import DelegatingStrategy


def dense_result(res: FitRes) -> FitRes:
    """``res`` with a coordinate-encoded upload decoded (the same object when it is dense already)."""
    if res.metrics.get(ENCODING_KEY) != SPARSE:
        return res
    arrays = decode_arrays(parameters_to_ndarrays(res.parameters))
    metrics = {k: v for k, v in res.metrics.items() if k != ENCODING_KEY}
    return FitRes(res.status, ndarrays_to_parameters(arrays), res.num_examples, metrics)


class SparseUploads(DelegatingStrategy):
    """Decode coordinate-encoded uploads, then do exactly what ``inner`` does."""

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Decode the sparse uploads, then aggregate as ``inner`` does."""
        return self.inner.aggregate_fit(server_round, [(proxy, dense_result(res)) for proxy, res in results], failures)
