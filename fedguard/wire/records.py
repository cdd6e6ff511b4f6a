"""The layout of fedguard's train messages, shared by the ClientApp and the server strategies.

A train instruction carries the global model (``ArrayRecord`` "arrays", keyed by the model's
``state_dict`` names) and a ``ConfigRecord`` "config" (``server-round``; ``partition-id``, the client the
server assigned to the node, which trains on that partition; and where Flower's strategies put theirs,
e.g. FedProx's ``proximal-mu``). A reply carries, as typed records:

- "arrays" (``ArrayRecord``): the upload, same keys as the model (coordinate-encoded uploads use
  ``encoded-<i>`` keys; the server decodes each once, in place, ``densify``: ``strategies.RoundGuard``
  for fedguard's server, ``strategies.SparseUploads`` for a strategy outside it);
- "metrics" (``MetricRecord``): ``num-examples`` and ``loss``, the same keys from every client, as
  Flower's built-in strategies require;
- "declared" (``ConfigRecord``): what the client declares with its upload: ``client`` (its partition, which
  the server checks against the one it assigned; ``strategies.upload_checks``),
  ``protocol``, ``lr``, ``batch-size``, local schedule, ``labels`` (a list, when the threat model grants
  them), ``encoding``, ``upload-bytes``, ``dense-bytes``;
- "defense" (``ConfigRecord``): the defense's reports (``fedguard.defenses.defense_report``);
- "detect" (``ConfigRecord``), when the client runs detectors (``fedguard.detect``): what they found of the model
  it received (``fedguard.detect.Verdict.row``: ``<detector>.<score>`` numbers, ``flagged``, ``action``).

A client whose detectors flagged the model declines the round per ``detect.action``: ``skip`` replies with
"metrics" (``num-examples`` 0), "declared" (its ``client``) and "detect", and no "arrays" (``declined_content``);
``refuse`` replies with an error whose reason starts with ``REFUSED``, followed by its findings as JSON
(``refusal_reason``). Neither is a failure: the server records the findings and leaves the client out of the
round (``read_findings``).

A client that cannot train in any round (a trained file it needs is missing or unusable, its configuration is
refused, its data set is absent) replies with an error whose reason starts with ``CANNOT_TRAIN``
(``cannot_train_reason``), so that the server stops the run with that reason instead of going on without it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedguard.wire.declared import Declared
from fedguard.wire.sparse import ENCODING_KEY, SPARSE, decode_arrays

ARRAYS = "arrays"
CONFIG = "config"
METRICS = "metrics"
DECLARED = "declared"
DEFENSE = "defense"
DETECT = "detect"
FINDING_PREFIX = "detect."  # prefix of the findings among what DefendedClient.fit returns
ROUND_KEY = "server-round"
NUM_EXAMPLES = "num-examples"
LOSS_KEY = "loss"
CLIENT_KEY = "client"
PARTITION_KEY = "partition-id"
PROXIMAL_MU_KEY = "proximal-mu"  # the key Flower's FedProx puts in the train config
CANNOT_TRAIN = "cannot train in any round: "
REFUSED = "refused the model: "
FINDING_ACTIONS = ("none", "report", "skip", "refuse")  # fedguard.detect.Verdict.row's ``action``
MAX_FINDINGS = 64  # entries of a client's findings the server reads (three detectors report 13)
MAX_FINDING_NAME = 64  # characters of a finding's name


def cannot_train_reason(error: Exception) -> str:
    """The error reason of a client reply that ``error`` will fail in every round."""
    return f"{CANNOT_TRAIN}{type(error).__name__}: {error}"


def cannot_train(reason: str | None) -> bool:
    """Whether an error reason says its client cannot train in any round (an error may come without one)."""
    return reason is not None and reason.startswith(CANNOT_TRAIN)


def refusal_reason(findings: Mapping[str, float | str]) -> str:
    """The error reason of a client that refuses the model: ``REFUSED`` and its findings as JSON."""
    return REFUSED + json.dumps(dict(findings), sort_keys=True)


def declined_content(client: int, findings: Mapping[str, float | str]) -> RecordDict:
    """The reply of a client that skips the round: no upload, its findings."""
    return RecordDict(
        {
            METRICS: MetricRecord({NUM_EXAMPLES: 0, LOSS_KEY: 0.0}),
            DECLARED: ConfigRecord({CLIENT_KEY: client}),
            DETECT: ConfigRecord(dict(findings)),
        }
    )


def declined(reply: Message) -> bool:
    """Whether a successful reply skips the round: findings and no upload."""
    return ARRAYS not in reply.content and DETECT in reply.content


def read_findings(reply: Message) -> dict[str, float | str] | None:
    """The findings a reply carries (a refusal's reason, or its "detect" record), None when it carries none;
    raises ``ValueError`` for findings that are not ``check_findings``'s."""
    if reply.has_error():
        reason = reply.error.reason or ""
        if not reason.startswith(REFUSED):
            return None
        try:
            findings = json.loads(reason[len(REFUSED) :])
        except ValueError:
            raise ValueError(f"a refusal whose findings are not JSON: {reason[:200]!r}") from None
    elif DETECT in reply.content:
        findings = reply.content[DETECT]
        if not isinstance(findings, ConfigRecord):
            raise ValueError(f"{DETECT!r} is a {type(findings).__name__}, expected a ConfigRecord")
    else:
        return None
    return check_findings(findings)


def check_findings(findings: Any) -> dict[str, float | str]:
    """``findings`` as read: at most ``MAX_FINDINGS`` entries named by strings of at most ``MAX_FINDING_NAME``
    characters, numbers but for ``action``, one of ``FINDING_ACTIONS``; raises ``ValueError`` naming the
    first entry that is not."""
    if not isinstance(findings, Mapping) or len(findings) > MAX_FINDINGS:
        raise ValueError(f"findings must be a mapping of at most {MAX_FINDINGS} entries")
    checked: dict[str, float | str] = {}
    for name, value in findings.items():
        if not isinstance(name, str) or len(name) > MAX_FINDING_NAME:
            raise ValueError(f"a finding's name must be a string of at most {MAX_FINDING_NAME} characters")
        if name == "action":
            if value not in FINDING_ACTIONS:
                raise ValueError(f"finding action = {str(value)[:40]!r}: expected one of {', '.join(FINDING_ACTIONS)}")
            checked[name] = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value):
            checked[name] = float(value)
        else:
            raise ValueError(f"finding {name!r} = {str(value)[:40]!r}: expected a number")
    return checked


def array_record(names: list[str] | tuple[str, ...], arrays: list[np.ndarray]) -> ArrayRecord:
    """``arrays`` keyed by ``names`` (same length)."""
    if len(names) != len(arrays):
        raise ValueError(f"{len(arrays)} arrays for {len(names)} names")
    arrays = [np.asarray(a) for a in arrays]  # numpy scalars (0-d results) become arrays
    return ArrayRecord(
        array_dict={
            name: Array(a if a.flags.c_contiguous else np.ascontiguousarray(a)) for name, a in zip(names, arrays)
        }
    )


def reply_content(
    arrays: ArrayRecord,
    num_examples: int,
    loss: float,
    declared: Mapping[str, Any],
    reports: Mapping[str, Any],
    findings: Mapping[str, float | str] | None = None,
) -> RecordDict:
    """A train reply's records, from their wire forms (with the detectors' ``findings`` when the client ran
    any); a client builds them from its ``ClientReply``."""
    content = RecordDict(
        {ARRAYS: arrays, METRICS: MetricRecord({NUM_EXAMPLES: int(num_examples), LOSS_KEY: float(loss)})}
    )
    annotate(content, declared, reports, findings)
    return content


def annotate(
    content: RecordDict,
    declared: Mapping[str, Any] | None = None,
    reports: Mapping[str, Any] | None = None,
    findings: Mapping[str, float | str] | None = None,
) -> None:
    """Write into a reply's ``content`` what its client declares (merged into the "declared" record it may hold
    already), its defense's ``reports`` and its detectors' ``findings``: the one writer of these records, for
    fedguard's ClientApp and for the mods in any app (``fedguard.flower.mods``)."""
    if declared is not None:
        held = content.get(DECLARED)
        content[DECLARED] = ConfigRecord({**(dict(held) if isinstance(held, ConfigRecord) else {}), **declared})
    if reports is not None:
        content[DEFENSE] = ConfigRecord(dict(reports))
    if findings:
        content[DETECT] = ConfigRecord(dict(findings))


def encoded_names(count: int) -> list[str]:
    """The keys of a coordinate-encoded upload of ``count`` arrays (``fedguard.wire.sparse``)."""
    return [f"encoded-{i}" for i in range(count)]


@dataclass(frozen=True)
class ClientReply:
    """One client's answer to a train instruction, typed from the client's step to the wire.

    ``upload``: as sent, one array per model entry, or coordinate-encoded ones when ``declared.encoding`` is
    ``sparse``; ``num_examples``: the examples it trained on; ``declared``: what it declares; ``reports``: its
    defense's (``defense.<name>`` numbers, ``fedguard.defenses.defense_report``); ``findings``: its detectors'
    (``fedguard.detect.Verdict.row``), empty when it runs none."""

    upload: list[np.ndarray]
    num_examples: int
    declared: Declared
    reports: Mapping[str, float] = field(default_factory=dict)
    findings: Mapping[str, float | str] = field(default_factory=dict)

    def content(self, names: Sequence[str]) -> RecordDict:
        """The reply's records (this module's layout); ``names``: the model's entries, in order."""
        keys = encoded_names(len(self.upload)) if self.declared.encoding == SPARSE else list(names)
        loss = self.declared.loss if self.declared.loss is not None else 0.0
        arrays = array_record(keys, self.upload)
        return reply_content(arrays, self.num_examples, loss, self.declared.record(), self.reports, self.findings)

    def metrics(self) -> dict[str, Any]:
        """The one flat mapping a ``NumPyClient.fit`` returns: the declared fields, the reports, and the findings
        under ``FINDING_PREFIX``."""
        findings = {f"{FINDING_PREFIX}{k}": v for k, v in self.findings.items()}
        return {**self.declared.record(), **self.reports, **findings}


@dataclass(frozen=True)
class Upload:
    """One client's train reply, read back on the server: what it ``declared`` typed (its ``encoding`` dropped
    once the upload is dense), its defense's ``reports``."""

    node: int
    client: int | None
    arrays: list[np.ndarray]
    num_examples: int
    declared: Declared
    reports: dict[str, Any]


def read_upload(reply: Message, arrays: bool = True) -> Upload:
    """The upload carried by a successful reply, dense (a coordinate-encoded one decoded, its ``encoding``
    dropped from what it declares); its ``arrays`` left empty unless ``arrays`` (reading them copies every
    array). Raises ``ValueError`` naming what is missing, or a declared value of the wrong type (the server's
    checks, ``strategies.upload_checks``, refuse those before anything reads the reply)."""
    content = reply.content
    for key, kind in ((ARRAYS, ArrayRecord), (METRICS, MetricRecord)):
        if key not in content or not isinstance(content[key], kind):
            raise ValueError(f"reply from node {reply.metadata.src_node_id} lacks the {kind.__name__} {key!r}")
    declared = dict(content[DECLARED]) if DECLARED in content else {}
    encoded = declared.get(ENCODING_KEY) == SPARSE
    if encoded:
        del declared[ENCODING_KEY]
    reports = dict(content[DEFENSE]) if DEFENSE in content else {}
    record = cast(ArrayRecord, content[ARRAYS])  # the kinds of both are checked above
    metrics: Mapping[str, Any] = cast(MetricRecord, content[METRICS])
    typed = Declared.read(declared)
    return Upload(
        node=reply.metadata.src_node_id,
        client=typed.client,
        arrays=(decode_arrays if encoded else list)(record.to_numpy_ndarrays()) if arrays else [],
        num_examples=int(metrics[NUM_EXAMPLES]),
        declared=typed,
        reports=reports,
    )


def densify(reply: Message, names: Sequence[str]) -> None:
    """Decode a successful reply's coordinate-encoded upload in place, once: its arrays dense and keyed by
    ``names`` (the model's entries), its ``encoding`` dropped from what it declares; a dense one is left as it
    is."""
    declared = reply.content.get(DECLARED)
    if not isinstance(declared, ConfigRecord) or declared.get(ENCODING_KEY) != SPARSE:
        return
    replace_arrays(reply, list(names), decode_arrays(cast(ArrayRecord, reply.content[ARRAYS]).to_numpy_ndarrays()))
    del declared[ENCODING_KEY]


def replace_arrays(reply: Message, names: list[str], arrays: list[np.ndarray]) -> None:
    """Put ``arrays`` (keyed by ``names``) in place of the reply's upload."""
    reply.content[ARRAYS] = array_record(names, arrays)
