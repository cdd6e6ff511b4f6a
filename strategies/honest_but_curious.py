"""A wrapper that lets any Strategy's server look at individual uploads.

The honest-but-curious server follows the protocol (aggregation is delegated,
unchanged, to the wrapped strategy) but copies chosen uploads, together with
the global model they were computed on, into ``Observation`` objects for an
attacker.
"""

from __future__ import annotations

import logging

import numpy as np
from flwr.common import FitIns, FitRes, Parameters, Scalar, parameters_to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from attackers.manipulation import HONEST
from attackers.sinks import ObservationSink
from fedguard.observation import UPLOAD_KINDS, ModelCard
from fedguard.selection import Selection
from strategies.delegating import DelegatingStrategy

log = logging.getLogger(__name__)

CLIENT_ID_KEY = "client"


class HonestButCurious(DelegatingStrategy):
    """Capture targeted uploads, then aggregate exactly as ``inner`` does.

    Parameters
    ----------
    inner : Strategy
        The strategy that samples clients and aggregates.
    sink : ObservationSink
        Receives one ``Observation`` per targeted upload; must not block.
    card : ModelCard
        The model the server distributes.
    upload_kind : str
        'gradient' (FedSGD) or 'weights' (FedAvg).
    rounds, clients : Selection
        Targeted rounds, and targeted client ids (the ``client`` metric each
        client reports with its upload).
    """

    def __init__(
        self,
        inner: Strategy,
        sink: ObservationSink,
        card: ModelCard,
        upload_kind: str,
        rounds: Selection,
        clients: Selection,
    ) -> None:
        super().__init__(inner)
        if upload_kind not in UPLOAD_KINDS:
            raise ValueError(f"upload_kind {upload_kind!r}: choose one of {', '.join(UPLOAD_KINDS)}")
        self.sink = sink
        self.card = card
        self.upload_kind = upload_kind
        self.rounds = rounds
        self.clients = clients
        self.captured = 0
        self._sent: dict[int, tuple[list[np.ndarray], str]] = {}

    def __repr__(self) -> str:
        return f"HonestButCurious({self.inner!r}, rounds={self.rounds.spec!r}, clients={self.clients.spec!r})"

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        """Keep the global model of targeted rounds, then configure as ``inner`` does."""
        if server_round in self.rounds:
            self._sent[server_round] = (parameters_to_ndarrays(parameters), HONEST)
        return self.inner.configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Hand targeted uploads to the sink, then aggregate as ``inner`` does."""
        sent = self._sent.pop(server_round, None)
        if sent is not None:
            for _, res in results:
                self._capture(server_round, *sent, res)
        return self.inner.aggregate_fit(server_round, results, failures)

    def _capture(self, server_round: int, sent: list[np.ndarray], manipulation: str, res: FitRes) -> None:
        if CLIENT_ID_KEY not in res.metrics:
            log.warning("round %d: an upload carries no %r metric; not captured", server_round, CLIENT_ID_KEY)
            return
        client = int(res.metrics[CLIENT_ID_KEY])
        if client not in self.clients:
            return
        declared = {k: v for k, v in res.metrics.items() if k != CLIENT_ID_KEY}
        obs = self.card.observe(
            server_round,
            client,
            self.upload_kind,
            [a.copy() for a in sent],
            parameters_to_ndarrays(res.parameters),
            res.num_examples,
            declared,
            manipulation,
        )
        self.sink.submit(obs)
        self.captured += 1
