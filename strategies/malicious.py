"""A malicious server: in scheduled rounds it sends a manipulated model, then captures the uploads.

The server changes the values (never the architecture) of the model it sends
to every node sampled in a scheduled round, with a registered manipulation
(``attackers.manipulation``), and records what it sent in each captured
``Observation``. Aggregation stays with the wrapped strategy, which keeps the
honest model: FedSGD takes its step from the honest parameters with the
gradients the clients computed on the manipulated ones; for weight uploads the
server applies the clients' mean change to the honest model
(``honest + aggregate - sent``). The utility cost of the attack is that round's
update having been computed on another model.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from attackers.manipulation import Manipulation
from attackers.sinks import ObservationSink
from fedguard.observation import ModelCard
from fedguard.records import array_record
from fedguard.selection import Selection
from strategies.honest_but_curious import HonestButCurious


class Malicious(HonestButCurious):
    """Capture as ``HonestButCurious`` does, and manipulate the model sent in scheduled rounds.

    Parameters
    ----------
    strategy, sink, card, upload_kind, rounds, clients
        As for ``HonestButCurious``.
    schedule : dict[int, tuple[str, Manipulation]]
        Round -> (manipulation name, manipulation) applied to the model sent in that round.
    seed : int
        Seed of the manipulations' randomness (one stream per round).
    """

    def __init__(
        self,
        strategy: Strategy,
        sink: ObservationSink,
        card: ModelCard,
        upload_kind: str,
        rounds: Selection,
        clients: Selection,
        schedule: dict[int, tuple[str, Manipulation]],
        seed: int = 0,
    ) -> None:
        super().__init__(strategy, sink, card, upload_kind, rounds, clients)
        bad = [r for r in schedule if r < 1]
        if bad:
            raise ValueError(f"schedule rounds must be >= 1, got {bad}")
        self.schedule = dict(schedule)
        self.seed = seed
        self._honest: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}

    def __repr__(self) -> str:
        plan = ", ".join(f"{r}:{name}" for r, (name, _) in sorted(self.schedule.items()))
        return f"Malicious({self.strategy!r}, schedule={plan!r}, rounds={self.rounds.spec!r})"

    def manipulated(self, server_round: int, honest: list[np.ndarray]) -> list[np.ndarray]:
        """The arrays sent in ``server_round`` in place of ``honest``; checked to keep shapes and dtypes."""
        name, manipulation = self.schedule[server_round]
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, server_round]))
        sent = manipulation([a.copy() for a in honest], self.card, rng)
        if len(sent) != len(honest) or any(s.shape != h.shape or s.dtype != h.dtype for s, h in zip(sent, honest)):
            raise ValueError(f"manipulation {name!r} changed the model's layout; it may only change values")
        return sent

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """In a scheduled round, configure as ``strategy`` does with the honest model, then send the
        manipulated one in its place."""
        if server_round not in self.schedule:
            return super().configure_train(server_round, arrays, config, grid)
        honest = arrays.to_numpy_ndarrays()
        sent = self.manipulated(server_round, honest)
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        self._honest[server_round] = (honest, sent)
        if self.targets_round(server_round):
            self.sent[server_round] = (sent, self.schedule[server_round][0])
        payload = array_record(list(arrays.keys()), sent)
        for message in messages:
            for key in list(message.content.array_records):
                message.content[key] = payload
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Capture and aggregate; after a manipulated round of weight uploads, move the honest model by
        the clients' change."""
        aggregated, metrics = super().aggregate_train(server_round, replies)
        honest_sent = self._honest.pop(server_round, None)
        if honest_sent is None or aggregated is None or self.upload_kind == "gradient":
            return aggregated, metrics
        honest, sent = honest_sent
        moved = [(h + (a - s)).astype(h.dtype) for h, a, s in zip(honest, aggregated.to_numpy_ndarrays(), sent)]
        return array_record(list(aggregated.keys()), moved), metrics
