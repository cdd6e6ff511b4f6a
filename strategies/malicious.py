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

A ``ClientManipulation`` (feature fishing) is a search across rounds instead: in
its rounds each node is sent its own model, each upload is handed back to the
manipulation (``learn``), and what it derives (the difference of two uploads
that isolates one example) is what the attacker receives, for a targeted round
and client. The server aggregates only the uploads computed on the honest model
in those rounds (of the nodes whose search is over), and keeps the model when
there are none: the others, computed on a magnified last layer, would wreck it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from attackers.manipulation import HONEST, ClientManipulation, Manipulation
from attackers.sinks import ObservationSink, held
from fedguard.observation import ModelCard
from fedguard.selection import Selection
from fedguard.wire.records import array_record, read_upload
from strategies.honest_but_curious import HonestButCurious, by_client


class Malicious(HonestButCurious):
    """Capture as ``HonestButCurious`` does, and manipulate the model sent in scheduled rounds.

    Parameters
    ----------
    strategy, sink, card, upload_kind, rounds, clients, per_round, secure
        As for ``HonestButCurious``.
    schedule : dict[int, tuple[str, Manipulation | ClientManipulation]]
        Round -> (manipulation name, manipulation) applied to the model sent in that round; a
        ``ClientManipulation`` needs gradient uploads (FedSGD).
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
        schedule: dict[int, tuple[str, Manipulation | ClientManipulation]],
        seed: int = 0,
        per_round: int = 0,
        secure: bool = False,
    ) -> None:
        super().__init__(strategy, sink, card, upload_kind, rounds, clients, per_round, secure)
        bad = [r for r in schedule if r < 1]
        if bad:
            raise ValueError(f"schedule rounds must be >= 1, got {bad}")
        searches = sorted({name for name, m in schedule.values() if isinstance(m, ClientManipulation)})
        if searches and upload_kind != "gradient":
            raise ValueError(
                f"manipulations {searches} search across rounds on gradient uploads (FedSGD), not {upload_kind}"
            )
        self.schedule = dict(schedule)
        self.seed = seed
        self._honest: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        self._per_node: dict[int, dict[int, tuple[list[np.ndarray], str]]] = {}
        """Round -> node -> (the arrays it was sent, the manipulation that made them), in a search's rounds."""

    def __repr__(self) -> str:
        plan = ", ".join(f"{r}:{name}" for r, (name, _) in sorted(self.schedule.items()))
        return f"Malicious({self.strategy!r}, schedule={plan!r}, rounds={self.rounds.spec!r})"

    def rng(self, server_round: int) -> np.random.Generator:
        """The manipulations' randomness in ``server_round``."""
        return np.random.default_rng(np.random.SeedSequence([self.seed, server_round]))

    def manipulated(self, server_round: int, honest: list[np.ndarray]) -> list[np.ndarray]:
        """The arrays sent in ``server_round`` in place of ``honest``; checked to keep shapes and dtypes."""
        name, manipulation = self.schedule[server_round]
        if isinstance(manipulation, ClientManipulation):
            raise TypeError(f"manipulation {name!r} sends each node its own model (configure_per_node)")
        return same_layout(name, manipulation([a.copy() for a in honest], self.card, self.rng(server_round)), honest)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """In a scheduled round, configure as ``strategy`` does with the honest model, then send the
        manipulated one in its place."""
        if server_round not in self.schedule:
            return super().configure_train(server_round, arrays, config, grid)
        if isinstance(self.schedule[server_round][1], ClientManipulation):
            return self.configure_per_node(server_round, arrays, config, grid)
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
        the clients' change. In a search's round, hand each upload to the search and keep the model."""
        if server_round in self._per_node:
            sent_by_node = self._per_node.pop(server_round)
            replies = list(replies)
            with held(self.sink):  # the round's captures reach the attacks as one batch
                self.learn(server_round, sent_by_node, replies)
            on_honest = [r for r in replies if sent_by_node.get(r.metadata.src_node_id, ((), ""))[1] == HONEST]
            return self.strategy.aggregate_train(server_round, on_honest) if on_honest else (None, None)
        aggregated, metrics = super().aggregate_train(server_round, replies)
        honest_sent = self._honest.pop(server_round, None)
        if honest_sent is None or aggregated is None or self.upload_kind == "gradient":
            return aggregated, metrics
        honest, sent = honest_sent
        moved = [(h + (a - s)).astype(h.dtype) for h, a, s in zip(honest, aggregated.to_numpy_ndarrays(), sent)]
        return array_record(list(aggregated.keys()), moved), metrics

    def configure_per_node(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> list[Message]:
        """Configure as ``strategy`` does with the honest model, then send each node what the search gives it (the
        honest model once its search is over)."""
        name, search = self.schedule[server_round]
        assert isinstance(search, ClientManipulation)
        honest, rng = arrays.to_numpy_ndarrays(), self.rng(server_round)
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        sent_by_node: dict[int, tuple[list[np.ndarray], str]] = {}
        for message in messages:
            node = message.metadata.dst_node_id
            sent = search.send(node, [a.copy() for a in honest], self.card, rng)
            sent_by_node[node] = (honest, HONEST) if sent is None else (same_layout(name, sent, honest), name)
            payload = array_record(list(arrays.keys()), sent_by_node[node][0])
            # a content of its own: the wrapped strategy's messages may share one RecordDict
            message.content = RecordDict({**message.content, **dict.fromkeys(message.content.array_records, payload)})
        self._per_node[server_round] = sent_by_node
        return messages

    def learn(
        self, server_round: int, sent_by_node: dict[int, tuple[list[np.ndarray], str]], replies: list[Message]
    ) -> None:
        """Hand each upload of a search's round to the search, and to the sink what it derives (for a targeted
        round and client); an upload on the honest model is captured as ``HonestButCurious`` does."""
        _, search = self.schedule[server_round]
        assert isinstance(search, ClientManipulation)
        readable = [r for r in replies if not r.has_error() and r.metadata.src_node_id in sent_by_node]
        for upload in by_client([read_upload(reply) for reply in readable]):
            sent, name = sent_by_node[upload.node]
            if name == HONEST:
                if self.targets_round(server_round):
                    self.capture(server_round, sent, HONEST, upload)
                continue
            obs = self.observation(server_round, sent, name, upload)
            derived = None if obs is None else search.learn(upload.node, obs)
            if (
                derived is not None
                and self.targets_round(server_round)
                and self.should_capture(server_round, upload)
                and not self.round_full(server_round)
            ):
                self.submit(server_round, derived)


def same_layout(name: str, sent: list[np.ndarray], honest: list[np.ndarray]) -> list[np.ndarray]:
    """``sent``, raising ``ValueError`` when manipulation ``name`` changed the shapes or dtypes of ``honest``."""
    if len(sent) != len(honest) or any(s.shape != h.shape or s.dtype != h.dtype for s, h in zip(sent, honest)):
        raise ValueError(f"manipulation {name!r} changed the model's layout; it may only change values")
    return sent
