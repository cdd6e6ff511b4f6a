"""The outermost wrapper of every fedguard server: client identities, per-round instructions, the checks of
every upload, reply accounting, dtypes.

- Clients are known by node id: at the first round the nodes connected are assigned clients 0..n-1 in
  node-id order, and each train instruction tells its node which (``partition-id``); a node that joins
  later is sent nothing. A reply's client is the one assigned to the node Flower says sent it, never the
  one it declares.
- Every upload is checked before anything else sees it (``strategies.upload_checks``); a refused one is
  left out of the round, with its client and the reason. One upload per instructed node and round.
- Evaluation is central (the ServerApp scores the global model on the held-out split), so no node is
  asked to evaluate.
- A client whose detectors flagged the model it received (``fedguard.detect``) may decline the round: it skips
  it (a reply with its findings and no upload) or refuses it (an error whose reason holds its findings;
  ``fedguard.wire.records``). Neither is a failure nor an upload: its client is left out of the round.
- Every round's replies are counted: ``on_replies(server_round, uploads, failed, rejected, findings, stragglers)``
  receives the accepted uploads, the clients that failed with their error reasons (``ClientFailure``; refusals not
  among them), the rejections and what each client's detectors found (``{"client", <finding>: value, ...}`` in client
  order) and the clients that sent no reply (stragglers: the round's ``timeout`` passed); a round in which no node
  succeeded (declining is not failing) stops the run with ``AllClientsFailed`` naming the reasons, instead of carrying
  on with an unchanged model; so does a client that says it cannot train in any round
  (``fedguard.wire.records.cannot_train``: a missing trained file, a refused configuration), whatever the others did;
  a round whose every upload was rejected or declined leaves the model as it was.
- The aggregate keeps the global model's dtypes (Flower's averaging turns integer buffers into floats).
- Rounds repeat exactly: the nodes a strategy samples (Flower's ``sample_nodes``) are drawn in node-id order
  from a generator seeded by the run seed and the round, and the accepted uploads reach aggregation in client
  order, so that the same seed gives the same clients and the same sums in every run.
- A resumed run (``rounds_done`` > 0) goes on from there: Flower's rounds 1, 2, ... are rounds
  ``rounds_done`` + 1, ... for every strategy inside.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable
from typing import Any, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedguard.wire.records import (
    CONFIG,
    DECLARED,
    PARTITION_KEY,
    Upload,
    array_record,
    cannot_train,
    declined,
    densify,
    read_findings,
    read_upload,
)
from strategies.client_failures import ClientFailure
from strategies.upload_checks import (
    Layout,
    Rejection,
    UploadRefused,
    UploadRules,
    check_identity,
    upload_problem,
)
from strategies.wrapper import StrategyWrapper

log = logging.getLogger(__name__)

# on_replies(round, accepted uploads, failed clients, rejections, findings, stragglers' clients)
OnReplies = Callable[[int, list[Upload], list[ClientFailure], list[Rejection], list[dict[str, Any]], list[int]], None]


class AllClientsFailed(RuntimeError):
    """No node returned an upload in a round, or one cannot train in any round."""


def assign_clients(node_ids: Iterable[int]) -> dict[int, int]:
    """Node id -> client id: 0, 1, ... in increasing node id."""
    return {node: client for client, node in enumerate(sorted(node_ids))}


class RoundGuard(StrategyWrapper):
    """Configure, check, account for and aggregate each round around ``strategy``.

    Parameters
    ----------
    strategy : Strategy
        The wrapped (decoding, capturing, aggregating) strategy.
    on_replies : OnReplies
        Called with each round's accepted uploads (their declarations and reports; not their arrays), the
        clients that failed (their error reasons), rejections, the clients' findings and the clients instructed
        that sent no reply (stragglers: Flower's round timeout passed), before aggregation.
    rules : UploadRules
        What the run lets a client declare.
    seed : int
        The run seed, from which each round's sampling generator is drawn.
    rounds_done : int
        Rounds completed before this strategy starts (a resumed run); Flower's round r is round rounds_done + r.
    """

    def __init__(
        self,
        strategy: Strategy,
        on_replies: OnReplies,
        rules: UploadRules,
        seed: int = 0,
        rounds_done: int = 0,
    ) -> None:
        super().__init__(strategy)
        self.on_replies = on_replies
        self.rules = rules
        self.seed = seed
        self.rounds_done = rounds_done
        self.clients: dict[int, int] = {}
        """Node id -> the client assigned to it at the first round."""
        self._layout = Layout((), (), ())
        self._instructions: dict[int, ConfigRecord] = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Configure as ``strategy`` does (sampling seeded by the round) and tell each node its client."""
        server_round += self.rounds_done
        if not self.clients:
            self.clients = assign_clients(grid.get_node_ids())
        self._layout = Layout.of(list(arrays.keys()), arrays.to_numpy_ndarrays())
        outside = random.getstate()
        random.seed(f"fedguard-sampling-{self.seed}-{server_round}")
        try:
            ordered = cast(Grid, NodesInOrder(grid))  # a Grid by delegation
            messages = list(self.strategy.configure_train(server_round, arrays, config, ordered))
        finally:
            random.setstate(outside)
        strangers = [m.metadata.dst_node_id for m in messages if m.metadata.dst_node_id not in self.clients]
        if strangers:
            log.warning(
                "round %d: nodes %s joined after the clients were assigned; they are sent nothing",
                server_round,
                strangers,
            )
        messages = [self.addressed(m) for m in messages if m.metadata.dst_node_id in self.clients]
        self._instructions = {m.metadata.dst_node_id: cast(ConfigRecord, m.content[CONFIG]) for m in messages}
        return messages

    def addressed(self, message: Message) -> Message:
        """``message`` with its own train config naming the client assigned to its node."""
        client = self.clients[message.metadata.dst_node_id]
        config = ConfigRecord({**cast(ConfigRecord, message.content[CONFIG]), PARTITION_KEY: client})
        message.content = RecordDict({**message.content, CONFIG: config})
        return message

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check and count the replies, stop when all failed, aggregate the accepted uploads as ``strategy``
        does, keep the dtypes."""
        server_round += self.rounds_done
        replies = list(replies)
        failed = [m for m in replies if m.has_error()]
        findings, refusals = self.refusals(failed)
        errors = [
            ClientFailure.of(self.clients.get(m.metadata.src_node_id), m.metadata.src_node_id, m.error.reason)
            for m in failed
            if m not in refusals
        ]
        skips, skip_rejections = self.skips([m for m in replies if not m.has_error() and declined(m)])
        accepted, rejected = self.screen([m for m in replies if not m.has_error() and not declined(m)])
        accepted.sort(key=lambda m: self.clients[m.metadata.src_node_id])
        for reply in accepted:  # checked: decoded once here, so that nothing after it decodes again
            densify(reply, self._layout.names)
        rejected += skip_rejections
        for reply in accepted + skips:
            findings[reply] = read_findings(reply)
        found = [
            {"client": self.clients[m.metadata.src_node_id], **f}
            for m, f in sorted(findings.items(), key=lambda item: self.clients[item[0].metadata.src_node_id])
            if f is not None
        ]
        replied = {m.metadata.src_node_id for m in replies}
        stragglers = sorted(self.clients[node] for node in self._instructions if node not in replied)
        uploads = [read_upload(m, arrays=False) for m in accepted]
        self.on_replies(server_round, uploads, errors, rejected, found, stragglers)
        permanent = [m for m in failed if cannot_train(m.error.reason)]
        if permanent:
            node = permanent[0].metadata.src_node_id
            raise AllClientsFailed(
                f"round {server_round}: client {self.clients.get(node, '?')} (node {node}) "
                f"{permanent[0].error.reason} ({len(permanent)} of {len(replies)} clients)"
            )
        if not accepted and not rejected and not refusals and not skips:
            reasons = "; ".join(map(str, errors[:3])) + (f"; ... ({len(errors) - 3} more)" if len(errors) > 3 else "")
            if stragglers:
                late = f"clients {stragglers} sent no reply within the round's timeout (server.round-timeout)"
                reasons = "; ".join(filter(None, [reasons, late]))
            raise AllClientsFailed(
                f"round {server_round}: every one of {len(errors) + len(stragglers)} clients failed "
                f"({reasons or 'no node replied'})"
            )
        aggregated, metrics = self.strategy.aggregate_train(server_round, failed + accepted)
        if aggregated is None:
            return None, metrics
        arrays = [
            np.rint(a).astype(d) if np.issubdtype(d, np.integer) and a.dtype != d else a.astype(d, copy=False)
            for a, d in zip(aggregated.to_numpy_ndarrays(), self._layout.dtypes)
        ]
        return array_record(list(aggregated.keys()), arrays), metrics

    def refusals(self, failed: list[Message]) -> tuple[dict[Message, Any], list[Message]]:
        """The findings of the failed replies that refuse the model, and those replies; a refusal from a node
        not assigned a client, or with findings that do not read, stays a failure."""
        findings: dict[Message, Any] = {}
        for reply in failed:
            try:
                found = read_findings(reply)
            except ValueError:
                continue
            if found is not None and reply.metadata.src_node_id in self.clients:
                findings[reply] = found
        return findings, list(findings)

    def skips(self, replies: list[Message]) -> tuple[list[Message], list[Rejection]]:
        """The replies that skip the round split into those accepted as skips (from an instructed node, as its
        client, with findings that read) and rejections."""
        accepted: list[Message] = []
        rejected: list[Rejection] = []
        for reply in replies:
            node = reply.metadata.src_node_id
            if self._instructions.pop(node, None) is None:
                rejected.append(Rejection(self.clients.get(node), f"node {node} skipped a round it was not asked to"))
                continue
            try:
                check_identity(self.clients[node], dict(reply.content[DECLARED]))
                read_findings(reply)
            except (UploadRefused, ValueError, TypeError, KeyError) as problem:
                rejected.append(Rejection(self.clients[node], f"a skip whose records do not read: {problem}"))
                continue
            accepted.append(reply)
        return accepted, rejected

    def screen(self, replies: list[Message]) -> tuple[list[Message], list[Rejection]]:
        """The successful replies split into accepted ones and rejections: one per instructed node, each
        passing ``upload_problem``."""
        accepted: list[Message] = []
        rejected: list[Rejection] = []
        instructions = dict(self._instructions)
        for reply in replies:
            node = reply.metadata.src_node_id
            instruction = instructions.pop(node, None)
            if instruction is None:
                rejected.append(
                    Rejection(self.clients.get(node), f"node {node} sent an upload it was not asked for this round")
                )
                continue
            problem = upload_problem(reply, self.clients[node], self._layout, self.rules, instruction)
            if problem is None:
                accepted.append(reply)
            else:
                rejected.append(Rejection(self.clients[node], problem))
        return accepted, rejected

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No node evaluates: the server scores the global model on the held-out split."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round + self.rounds_done, replies)


class NodesInOrder:
    """``grid`` whose ``get_node_ids`` lists the nodes in increasing id, so that a seeded sample picks the same
    clients whatever ids the nodes got."""

    def __init__(self, grid: Grid) -> None:
        self._grid = grid

    def get_node_ids(self) -> list[int]:
        return sorted(self._grid.get_node_ids())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)
