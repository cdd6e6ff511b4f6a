"""A malicious server: in scheduled rounds it sends a manipulated model, then captures the uploads.

The server changes the values (never the architecture) of the model it sends
to every client sampled in a scheduled round, with a registered manipulation
(``attackers.manipulation``), and records what it sent in each captured
``Observation``. Aggregation stays with the wrapped strategy, which keeps the
honest model: FedSGD takes its step from the honest parameters with the
gradients the clients computed on the manipulated ones; for FedAvg weight
uploads the server applies the clients' mean change to the honest model
(``honest + aggregate - sent``). The utility cost of the attack is that round's
update having been computed on another model.
"""

from __future__ import annotations

import numpy as np
from flwr.common import FitIns, FitRes, Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import Strategy

from attackers.manipulation import Manipulation
from attackers.sinks import ObservationSink
from fedguard.observation import ModelCard
from fedguard.selection import Selection
from strategies.honest_but_curious import HonestButCurious


class Malicious(HonestButCurious):
    """Capture as ``HonestButCurious`` does, and manipulate the model sent in scheduled rounds.

    Parameters
    ----------
    inner, sink, card, upload_kind, rounds, clients
        As for ``HonestButCurious``.
    schedule : dict[int, tuple[str, Manipulation]]
        Round -> (manipulation name, manipulation) applied to the model sent in that round.
    seed : int
        Seed of the manipulations' randomness (one stream per round).
    """

    def __init__(
        self,
        inner: Strategy,
        sink: ObservationSink,
        card: ModelCard,
        upload_kind: str,
        rounds: Selection,
        clients: Selection,
        schedule: dict[int, tuple[str, Manipulation]],
        seed: int = 0,
    ) -> None:
        super().__init__(inner, sink, card, upload_kind, rounds, clients)
        bad = [r for r in schedule if r < 1]
        if bad:
            raise ValueError(f"schedule rounds must be >= 1, got {bad}")
        self.schedule = dict(schedule)
        self.seed = seed
        self._honest: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}

    def __repr__(self) -> str:
        plan = ", ".join(f"{r}:{name}" for r, (name, _) in sorted(self.schedule.items()))
        return f"Malicious({self.inner!r}, schedule={plan!r}, rounds={self.rounds.spec!r})"

    def manipulated(self, server_round: int, honest: list[np.ndarray]) -> list[np.ndarray]:
        """The arrays sent in ``server_round`` in place of ``honest``; checked to keep shapes and dtypes."""
        name, manipulation = self.schedule[server_round]
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, server_round]))
        sent = manipulation([a.copy() for a in honest], self.card, rng)
        if len(sent) != len(honest) or any(s.shape != h.shape or s.dtype != h.dtype for s, h in zip(sent, honest)):
            raise ValueError(f"manipulation {name!r} changed the model's layout; it may only change values")
        return sent

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        """In a scheduled round, configure as ``inner`` does with the honest model, then send the manipulated one."""
        if server_round not in self.schedule:
            return super().configure_fit(server_round, parameters, client_manager)
        honest = parameters_to_ndarrays(parameters)
        sent = self.manipulated(server_round, honest)
        instructions = self.inner.configure_fit(server_round, parameters, client_manager)
        self._honest[server_round] = (honest, sent)
        if server_round in self.rounds:
            self._sent[server_round] = (sent, self.schedule[server_round][0])
        payload = ndarrays_to_parameters(sent)
        return [(proxy, FitIns(payload, ins.config)) for proxy, ins in instructions]

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Capture and aggregate; after a manipulated FedAvg round, move the honest model by the clients' change."""
        aggregated, metrics = super().aggregate_fit(server_round, results, failures)
        honest_sent = self._honest.pop(server_round, None)
        if honest_sent is None or aggregated is None or self.upload_kind == "gradient":
            return aggregated, metrics
        honest, sent = honest_sent
        moved = [(h + (a - s)).astype(h.dtype) for h, a, s in zip(honest, parameters_to_ndarrays(aggregated), sent)]
        return ndarrays_to_parameters(moved), metrics
