"""What the server accepts of a client's train reply before the upload touches the global model.

A reply is refused (``UploadRefused``, whose message is the reason) when

- its records are not the layout of ``fedguard.wire.records``: one ``ArrayRecord`` "arrays", one ``MetricRecord``
  "metrics" holding exactly ``num-examples`` (an integer) and ``loss`` (a number), a ``ConfigRecord``
  "declared", defense reports that are numbers, detector findings as ``fedguard.wire.records.check_findings`` reads
  them;
- the client it declares is not the one the server assigned to the node that sent it;
- an array differs from the global model's in number, name, shape or dtype, or holds a NaN or an infinity; a
  coordinate-encoded upload (``fedguard.wire.sparse``) breaks that format's invariants (int32 positions, strictly
  increasing, inside the array, or a uint8 bit mask of the array's length with zero padding; as many values as
  entries named; the model's shape, as int64);
- a declared size contradicts the upload or the run (``UploadRules``): more examples than the client's
  partition holds, a batch larger than the run's ``train.batch-size`` or than the examples, another learning
  rate, local schedule or protocol than the run's, labels that are not one class per example, byte counts
  that are not those of the arrays sent.

Headers are read before data: an array whose ``.npy`` header names another shape or dtype than the model's
is refused without being loaded, so a claimed size cannot make the server allocate it.

``nonfinite_problem`` also looks at the global model after each round: one holding a NaN or an infinity
stops the run with ``NonFiniteModel`` (``fedguard.runtime.server_app``).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard, cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from numpy.lib import format as npy

from fedguard.defenses.base import REPORT_PREFIX
from fedguard.limits import shown
from fedguard.protocols import protocol
from fedguard.wire.declared import wire_key
from fedguard.wire.records import (
    ARRAYS,
    CLIENT_KEY,
    DECLARED,
    DEFENSE,
    DETECT,
    LOSS_KEY,
    METRICS,
    NUM_EXAMPLES,
    PROXIMAL_MU_KEY,
    check_findings,
)
from fedguard.wire.sparse import ENCODING_KEY, INDEX, MASK, PARTS, SHAPE, SPARSE, mask_bytes, mask_flags, position_bytes
from fedguard.wire.sparse import check_positions as positions_in_range

NPY_HEADERS = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}


class UploadRefused(ValueError):
    """A reply the server does not aggregate; the message says why."""


class NonFiniteModel(RuntimeError):
    """The global model holds a NaN or an infinity after a round."""


@dataclass(frozen=True)
class Rejection:
    """One refused reply: the client the server assigned to its node (None for a node it assigned none)
    and why."""

    client: int | None
    reason: str

    def row(self) -> dict[str, Any]:
        """The entry of ``rejected`` in the round's row of ``rounds.jsonl``."""
        return {"client": self.client, "reason": self.reason}


@dataclass(frozen=True)
class Layout:
    """The global model's arrays: ``names`` (its ``state_dict`` keys), ``shapes`` and ``dtypes``."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]

    @classmethod
    def of(cls, names: Sequence[str], arrays: Sequence[np.ndarray]) -> Layout:
        """The layout of ``arrays`` keyed by ``names``."""
        return cls(tuple(names), tuple(a.shape for a in arrays), tuple(a.dtype for a in arrays))

    @property
    def nbytes(self) -> int:
        """Bytes of the model's arrays, dense."""
        return sum(math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes))


@dataclass(frozen=True)
class UploadRules:
    """What the run lets a client declare.

    ``protocol`` (a name of ``fedguard.protocols``), ``lr``, ``batch_size`` (samples per batch, at most) and
    ``local_epochs``: the run's ``train.*``; ``num_classes``: labels are in [0, num_classes);
    ``partition_sizes``: samples each client holds, by client id."""

    protocol: str
    lr: float
    batch_size: int
    local_epochs: int
    num_classes: int
    partition_sizes: tuple[int, ...]


def upload_problem(
    reply: Message, client: int, layout: Layout, rules: UploadRules, instruction: Mapping[str, Any]
) -> str | None:
    """Why the server refuses ``reply`` (a successful train reply of the node assigned ``client``, answering
    the train config ``instruction``), or None to accept it."""
    try:
        check_records(reply.content)
        declared = dict(reply.content[DECLARED])
        check_identity(client, declared)
        num_examples = check_metrics(cast(MetricRecord, reply.content[METRICS]))  # check_records checked the kinds
        check_declared(rules, client, num_examples, declared, instruction)
        record = cast(ArrayRecord, reply.content[ARRAYS])
        sent = check_sparse(layout, record) if declared.get(ENCODING_KEY) == SPARSE else check_dense(layout, record)
        check_byte_counts(declared, sent, layout.nbytes)
    except UploadRefused as refused:
        return str(refused)
    return None


def check_records(content: RecordDict) -> None:
    """The reply holds the records of ``fedguard.wire.records`` and no other array or metric record."""
    if list(content.array_records) != [ARRAYS]:
        raise UploadRefused(f"holds the array records {shown(sorted(content.array_records))}, expected [{ARRAYS!r}]")
    if list(content.metric_records) != [METRICS]:
        raise UploadRefused(f"holds the metric records {shown(sorted(content.metric_records))}, expected [{METRICS!r}]")
    if not isinstance(content.get(DECLARED), ConfigRecord):
        raise UploadRefused(f"lacks the ConfigRecord {DECLARED!r}")
    if DEFENSE in content:
        check_reports(content[DEFENSE])
    if DETECT in content:
        if not isinstance(content[DETECT], ConfigRecord):
            raise UploadRefused(f"{DETECT!r} is a {type(content[DETECT]).__name__}, expected a ConfigRecord")
        try:
            check_findings(content[DETECT])
        except ValueError as error:
            raise UploadRefused(f"{DETECT!r}: {error}") from None


def check_reports(reports: Any) -> None:
    """Defense reports are a ``ConfigRecord`` of numbers named ``defense.*``."""
    if not isinstance(reports, ConfigRecord):
        raise UploadRefused(f"{DEFENSE!r} is a {type(reports).__name__}, expected a ConfigRecord")
    for key, value in reports.items():
        if not key.startswith(REPORT_PREFIX) or not is_real(value):
            raise UploadRefused(
                f"defense report {shown(key)} = {shown(value)}: expected a number named {REPORT_PREFIX}<name>"
            )


def check_identity(client: int, declared: Mapping[str, Any]) -> None:
    """The client declared is the one the server assigned to the node."""
    claimed = declared.get(CLIENT_KEY)
    if not is_integer(claimed) or claimed != client:
        raise UploadRefused(f"declares {CLIENT_KEY} {shown(claimed)}, but its node is client {client}")


def check_metrics(metrics: MetricRecord) -> int:
    """The reply's metrics are exactly ``num-examples`` (an integer >= 1) and ``loss`` (a number: a manipulated
    model may give an infinite one); returns the number of examples."""
    if set(metrics) != {NUM_EXAMPLES, LOSS_KEY}:
        raise UploadRefused(
            f"reports the metrics {shown(sorted(metrics))}, expected {sorted((NUM_EXAMPLES, LOSS_KEY))}"
        )
    num_examples, loss = metrics[NUM_EXAMPLES], metrics[LOSS_KEY]
    if not is_integer(num_examples) or num_examples < 1:
        raise UploadRefused(f"{NUM_EXAMPLES} = {shown(num_examples)}: expected an integer >= 1")
    if not is_real(loss):
        raise UploadRefused(f"{LOSS_KEY} = {shown(loss)}: expected a number")
    return int(num_examples)


def check_declared(
    rules: UploadRules, client: int, num_examples: int, declared: Mapping[str, Any], instruction: Mapping[str, Any]
) -> None:
    """The sizes and hyper-parameters declared agree with the run, the client's partition and each other."""
    if not 0 <= client < len(rules.partition_sizes):
        raise UploadRefused(f"client {client} holds no partition of the run's {len(rules.partition_sizes)}")
    holds = rules.partition_sizes[client]
    if num_examples > holds:
        raise UploadRefused(f"{NUM_EXAMPLES} = {num_examples}: client {client} holds {holds} samples")
    if protocol(rules.protocol).one_batch and num_examples > rules.batch_size:
        raise UploadRefused(
            f"{NUM_EXAMPLES} = {num_examples}: a {rules.protocol} upload is one batch of at most "
            f"train.batch-size = {rules.batch_size}"
        )
    expect_equal(declared, wire_key("protocol"), rules.protocol, "the run's train.protocol")
    expect_equal(declared, wire_key("lr"), rules.lr, "the run's train.lr")
    expect_equal(declared, wire_key("local_epochs"), rules.local_epochs, "the run's train.local-epochs")
    expect_equal(declared, wire_key("proximal_mu"), instruction.get(PROXIMAL_MU_KEY), "the value the server sent")
    batch = check_batch_size(rules, num_examples, declared)
    if wire_key("local_steps") in declared:
        steps, schedule = protocol(rules.protocol).local_steps(num_examples, batch, rules.local_epochs)
        expect_equal(declared, wire_key("local_steps"), steps, schedule)
    if wire_key("labels") in declared:
        check_labels(declared[wire_key("labels")], num_examples, rules.num_classes)
    if wire_key("encoding") in declared and declared[wire_key("encoding")] != SPARSE:
        raise UploadRefused(f"{ENCODING_KEY} = {shown(declared[ENCODING_KEY])}: expected {SPARSE!r} or none")


def expect_equal(declared: Mapping[str, Any], key: str, expected: Any, what: str) -> None:
    """``declared[key]``, when declared, equals ``expected`` (``what`` it is)."""
    if key not in declared:
        return
    value = declared[key]
    if isinstance(value, bool) or value != expected:
        raise UploadRefused(f"declares {key} = {shown(value)}, expected {shown(expected)} ({what})")


def check_batch_size(rules: UploadRules, num_examples: int, declared: Mapping[str, Any]) -> int:
    """The declared ``batch-size`` (else the run's, capped by the examples) is at most the run's
    ``train.batch-size`` and the examples, and equals the examples of a FedSGD upload; returns it."""
    batch = declared.get(wire_key("batch_size"), min(rules.batch_size, num_examples))
    if not is_integer(batch) or not 1 <= batch <= min(rules.batch_size, num_examples):
        raise UploadRefused(
            f"declares batch-size = {shown(batch)}, expected an integer in [1, "
            f"{min(rules.batch_size, num_examples)}] (train.batch-size = {rules.batch_size}, "
            f"{NUM_EXAMPLES} = {num_examples})"
        )
    if protocol(rules.protocol).one_batch and batch != num_examples:
        raise UploadRefused(
            f"declares batch-size = {batch}, but a {rules.protocol} upload of {num_examples} examples is "
            f"one batch of {num_examples}"
        )
    return int(batch)


def check_labels(labels: Any, num_examples: int, num_classes: int) -> None:
    """``labels`` is one class in [0, num_classes) per example."""
    if not isinstance(labels, list) or len(labels) != num_examples:
        raise UploadRefused(f"declares labels {shown(labels)}, expected a list of {num_examples} classes")
    bad = [v for v in labels if not is_integer(v) or not 0 <= v < num_classes]
    if bad:
        raise UploadRefused(f"declares the label {shown(bad[0])}, expected a class in [0, {num_classes})")


def check_dense(layout: Layout, record: ArrayRecord) -> int:
    """A dense upload: the model's arrays by name, shape and dtype, finite. Returns the bytes sent."""
    if list(record) != list(layout.names):
        raise UploadRefused(
            f"uploads {len(record)} arrays {shown(list(record))}, expected the model's "
            f"{len(layout.names)} {shown(list(layout.names))}"
        )
    sent = 0
    for name, shape, dtype in zip(layout.names, layout.shapes, layout.dtypes):
        check_header(name, record[name], shape, dtype)
        values = load(name, record[name])
        check_finite(name, values)
        sent += values.nbytes
    return sent


def check_sparse(layout: Layout, record: ArrayRecord) -> int:
    """A coordinate-encoded upload (``fedguard.wire.sparse``): per model array, where its sent entries are (int32
    positions strictly increasing inside the array, or a uint8 bit mask of the array's length with zero
    padding), as many finite values of the model's dtype, and the model's shape (int64). Returns the bytes
    sent."""
    parts = list(record.values())
    if len(parts) != PARTS * len(layout.names):
        raise UploadRefused(
            f"uploads {len(parts)} encoded arrays, expected {PARTS} per model array: {PARTS * len(layout.names)}"
        )
    sent = 0
    for i, (name, shape, dtype) in enumerate(zip(layout.names, layout.shapes, layout.dtypes)):
        where, values, encoded_shape = parts[PARTS * i : PARTS * (i + 1)]
        check_header(f"{name} (shape)", encoded_shape, (len(shape),), SHAPE)
        encoded = tuple(load(name, encoded_shape).tolist())
        if encoded != shape:
            raise UploadRefused(f"array {name!r} is encoded with the shape {encoded}, expected {shape}")
        size = math.prod(shape)
        count = encoded_count(name, where, size)
        check_header(f"{name} (values)", values, (count,), dtype)
        check_finite(name, load(name, values))
        sent += position_bytes(size, count) + count * dtype.itemsize + len(shape) * SHAPE.itemsize
    return sent


def encoded_count(name: str, where: Array, size: int) -> int:
    """The number of entries sent of an encoded array of ``size`` entries: int32 positions (k,), k <= ``size``,
    strictly increasing inside the array, or a uint8 mask (ceil(size/8),) with zero padding bits."""
    shape, dtype = header(name, where)
    if dtype == MASK and shape == (mask_bytes(size),):
        try:
            return int(np.count_nonzero(mask_flags(load(name, where), size)))
        except ValueError as error:
            raise UploadRefused(f"array {name!r} is encoded with a bad mask: {error}") from None
    if dtype != INDEX or len(shape) != 1 or shape[0] > size:
        raise UploadRefused(
            f"array {name!r} is encoded with positions {dtype} {shape}, expected {INDEX} "
            f"(k,) with k <= {size} or a {MASK} mask ({mask_bytes(size)},)"
        )
    check_positions(name, load(name, where), size)
    return int(shape[0])


def check_positions(name: str, indices: np.ndarray, size: int) -> None:
    """Flat positions strictly increasing in [0, size) (``fedguard.wire.sparse.check_positions``)."""
    try:
        positions_in_range(indices, size, len(indices))
    except ValueError:
        raise UploadRefused(
            f"array {name!r} is encoded with positions that are not strictly increasing in [0, {size})"
        ) from None


def check_header(name: str, array: Array, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """The ``.npy`` header of ``array`` names ``shape`` and ``dtype``."""
    got_shape, got_dtype = header(name, array)
    if got_dtype != dtype:
        raise UploadRefused(f"array {name!r} is {got_dtype}, expected {dtype}")
    if got_shape != shape:
        raise UploadRefused(f"array {name!r} has shape {got_shape}, expected {shape}")


def header(name: str, array: Array) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) from the ``.npy`` header of a serialized ``Array``, without reading its data."""
    stream = io.BytesIO(array.data)
    try:
        read = NPY_HEADERS.get(npy.read_magic(stream))
        if read is None:
            raise ValueError("a .npy format version other than 1.0 and 2.0")
        shape, _, dtype = read(stream)
    except ValueError as error:
        raise UploadRefused(f"array {name!r} is not a .npy array: {error}") from None
    return tuple(shape), dtype


def load(name: str, array: Array) -> np.ndarray:
    """The numpy array of a serialized ``Array`` whose header was checked."""
    try:
        return array.numpy()
    except (ValueError, TypeError, EOFError, OSError) as error:
        raise UploadRefused(f"array {name!r} cannot be read: {error}") from None


def check_finite(name: str, values: np.ndarray) -> None:
    """No NaN or infinity in ``values``."""
    problem = nonfinite_problem([name], [values])
    if problem is not None:
        raise UploadRefused(problem)


def nonfinite_problem(names: Sequence[str], arrays: Sequence[np.ndarray]) -> str | None:
    """The first array of ``arrays`` (keyed by ``names``) holding a NaN or an infinity, described, or None."""
    for name, values in zip(names, arrays):
        if values.dtype.kind in "fc" and not np.isfinite(values).all():
            bad = int(values.size - np.count_nonzero(np.isfinite(values)))
            return f"array {name!r} holds {bad} NaN or infinite entries of {values.size}"
    return None


def check_byte_counts(declared: Mapping[str, Any], sent: int, dense: int) -> None:
    """``upload-bytes`` and ``dense-bytes``, when declared, are the bytes sent and the model's dense bytes."""
    expect_equal(declared, wire_key("upload_bytes"), sent, "the bytes of the arrays sent")
    expect_equal(declared, wire_key("dense_bytes"), dense, "the model's bytes, dense")


def is_integer(value: Any) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> TypeGuard[int | float]:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
