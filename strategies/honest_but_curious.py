"""A wrapper that lets any Strategy's server look at individual uploads.

The honest-but-curious server follows the protocol (aggregation is left,
unchanged, to the wrapped strategy) but copies chosen uploads, together with
the global model they were computed on, into ``Observation`` objects for an
attacker.

What is captured is decided by one hook, ``should_capture(server_round, upload)``:
by default an upload of a targeted round from a targeted client. A subclass
overrides it to choose otherwise (the largest uploads, the clients declaring
the smallest batch, ...); ``tests/test_capture.py`` has one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from attackers.manipulation import HONEST
from attackers.sinks import ObservationSink, held
from fedguard.aggregate import AGGREGATE_CLIENT, aggregate_declaration, weighted_mean
from fedguard.observation import UPLOAD_KINDS, ModelCard, Observation
from fedguard.selection import Selection
from fedguard.wire.records import CLIENT_KEY, Upload, read_upload
from strategies.wrapper import StrategyWrapper

log = logging.getLogger(__name__)


class HonestButCurious(StrategyWrapper):
    """Capture chosen uploads, then aggregate exactly as ``strategy`` does.

    Parameters
    ----------
    strategy : Strategy
        The strategy that samples nodes and aggregates.
    sink : ObservationSink
        Receives one ``Observation`` per captured upload; must not block.
    card : ModelCard
        The model the server distributes.
    upload_kind : str
        'gradient' (FedSGD) or 'weights' (FedAvg).
    rounds, clients : Selection
        Targeted rounds, and targeted client ids (the ``client`` of each upload: under ``RoundGuard``, the one
        the server assigned to the node that sent it).
    per_round : int
        At most this many captures a round, the uploads of the lowest client ids first (0: no limit), so that
        a run whose rounds sample few of the targeted clients still yields the same count each round.
    secure : bool
        Secure aggregation: the server sees only the round's example-weighted mean of the uploads it aggregates
        (``fedguard.aggregate``), captured as one observation of ``AGGREGATE_CLIENT`` in each targeted round;
        ``clients``, ``per_round`` and ``should_capture`` then choose nothing.
    """

    def __init__(
        self,
        strategy: Strategy,
        sink: ObservationSink,
        card: ModelCard,
        upload_kind: str,
        rounds: Selection,
        clients: Selection,
        per_round: int = 0,
        secure: bool = False,
    ) -> None:
        super().__init__(strategy)
        if per_round < 0:
            raise ValueError(f"per_round = {per_round}: expected 0 (no limit) or a positive count")
        if upload_kind not in UPLOAD_KINDS:
            raise ValueError(f"upload_kind {upload_kind!r}: choose one of {', '.join(UPLOAD_KINDS)}")
        self.sink = sink
        self.card = card
        self.upload_kind = upload_kind
        self.rounds = rounds
        self.clients = clients
        self.per_round = per_round
        self.secure = secure
        self.captured_in: dict[int, int] = {}
        """Round -> uploads captured in it."""
        self.sent: dict[int, tuple[list[np.ndarray], str]] = {}
        """Round -> (the model sent to the clients, the manipulation that made it), for targeted rounds."""

    @property
    def captured(self) -> int:
        """Uploads captured so far, in every round."""
        return sum(self.captured_in.values())

    def __repr__(self) -> str:
        limit = f", per_round={self.per_round}" if self.per_round else ""
        return (
            f"{type(self).__name__}({self.strategy!r}, rounds={self.rounds.spec!r}, "
            f"clients={self.clients.spec!r}{limit})"
        )

    def targets_round(self, server_round: int) -> bool:
        """Whether uploads of ``server_round`` may be captured (the model sent is then kept)."""
        return server_round in self.rounds

    def should_capture(self, server_round: int, upload: Upload) -> bool:
        """The capture hook: whether to hand ``upload`` (of a targeted round) to the attacker.

        ``upload`` holds the arrays, ``num_examples``, what the client ``declared`` and its defense
        ``reports``. By default: the uploads of the targeted clients."""
        return upload.client is not None and upload.client in self.clients

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Keep the global model of targeted rounds, then configure as ``strategy`` does."""
        if self.targets_round(server_round):
            self.sent[server_round] = (arrays.to_numpy_ndarrays(), HONEST)
        return self.strategy.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Hand the chosen uploads to the sink, then aggregate as ``strategy`` does."""
        replies = list(replies)
        sent = self.sent.pop(server_round, None)
        if sent is not None:
            uploads = by_client([read_upload(reply) for reply in replies if not reply.has_error()])
            with held(self.sink):  # the round's captures reach the attacks as one batch
                if self.secure:
                    self.capture_aggregate(server_round, *sent, uploads)
                else:
                    for upload in uploads:
                        self.capture(server_round, *sent, upload)
        return self.strategy.aggregate_train(server_round, replies)

    def capture_aggregate(
        self, server_round: int, sent: list[np.ndarray], manipulation: str, uploads: list[Upload]
    ) -> None:
        """Submit one ``Observation`` of the round's aggregate of ``uploads`` (those naming their client)."""
        named = [u for u in uploads if u.client is not None]
        if not named:
            return
        counts = [u.num_examples for u in named]
        declared = aggregate_declaration(
            [u.client for u in named if u.client is not None],
            [u.declared for u in named],
            counts,
            self.upload_kind == "gradient",
        )
        obs = self.card.observe(
            server_round,
            AGGREGATE_CLIENT,
            self.upload_kind,
            [a.copy() for a in sent],
            weighted_mean([u.arrays for u in named], counts),
            sum(counts),
            declared,
            manipulation,
        )
        self.submit(server_round, obs)

    def capture(self, server_round: int, sent: list[np.ndarray], manipulation: str, upload: Upload) -> None:
        """Submit an ``Observation`` of ``upload`` when ``should_capture`` says so."""
        if upload.client is not None and not self.should_capture(server_round, upload):
            return
        if self.round_full(server_round):
            return
        obs = self.observation(server_round, sent, manipulation, upload)
        if obs is not None:
            self.submit(server_round, obs)

    def round_full(self, server_round: int) -> bool:
        """Whether ``server_round`` already holds ``per_round`` captures."""
        return 0 < self.per_round <= self.captured_in.get(server_round, 0)

    def submit(self, server_round: int, obs: Observation) -> None:
        """Hand ``obs`` to the sink and count it."""
        self.sink.submit(obs)
        self.captured_in[server_round] = self.captured_in.get(server_round, 0) + 1

    def observation(
        self, server_round: int, sent: list[np.ndarray], manipulation: str, upload: Upload
    ) -> Observation | None:
        """What the server saw of ``upload``, computed on ``sent``; None (with a warning) when it names no client."""
        if upload.client is None:
            log.warning(
                "round %d: an upload from node %d declares no %r; not captured", server_round, upload.node, CLIENT_KEY
            )
            return None
        declared = upload.declared.with_fields(client=None)
        return self.card.observe(
            server_round,
            upload.client,
            self.upload_kind,
            [a.copy() for a in sent],
            upload.arrays,
            upload.num_examples,
            declared,
            manipulation,
        )


def by_client(uploads: list[Upload]) -> list[Upload]:
    """``uploads`` in order of their client ids (those naming none last), the order captures are taken in."""
    return sorted(uploads, key=lambda u: (u.client is None, u.client if u.client is not None else 0))
