"""What a client declares with its upload: one typed record, filled by the client, checked by the server and read
by the attacks.

On the wire it is the reply's "declared" ``ConfigRecord`` (``fedguard.wire.records``), each field under its name with
dashes (``batch_size`` is ``batch-size``); a field left None is not sent. A captured upload keeps the same mapping
in ``Observation.declared`` (without ``client``, which the observation holds itself), where the server may add
what it derived (``extra``: e.g. feature fishing's ``isolated``). ``strategies.upload_checks`` checks a received
mapping value by value before anything reads it as a ``Declared``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from fedguard.wire.sparse import ENCODING_KEY


@dataclass(frozen=True)
class Declared:
    """The fields a client may declare (None: not declared).

    ``client``: its partition id; ``protocol``, ``lr``, ``local_epochs``, ``proximal_mu``: the run's values it
    trained with (FedProx's weight as the server sent it); ``batch_size``: samples per batch; ``local_steps``:
    SGD steps in the round; ``loss``: the last training loss; ``labels``: the batch's labels, where the threat
    model grants them; ``encoding``: ``sparse`` for a coordinate-encoded upload; ``upload_bytes`` and
    ``dense_bytes``: its size as sent and dense; ``extra``: any other key, as received."""

    client: int | None = None
    protocol: str | None = None
    lr: float | None = None
    batch_size: int | None = None
    local_epochs: int | None = None
    local_steps: int | None = None
    loss: float | None = None
    proximal_mu: float | None = None
    labels: tuple[int, ...] | None = None
    encoding: str | None = None
    upload_bytes: int | None = None
    dense_bytes: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The wire form: each declared field under its key, then ``extra``."""
        wire: dict[str, Any] = {}
        for name, key in WIRE_KEYS.items():
            value = getattr(self, name)
            if value is not None:
                wire[key] = list(value) if name == "labels" else value
        return {**wire, **self.extra}

    @classmethod
    def read(cls, record: Mapping[str, Any]) -> Declared:
        """The typed view of a declared mapping whose values the server checked (``strategies.upload_checks``) or
        that a capture kept; raises ``ValueError`` naming a key whose value has the wrong type."""
        values: dict[str, Any] = {}
        for name, key in WIRE_KEYS.items():
            if key in record and record[key] is not None:
                values[name] = _typed(key, record[key], FIELD_TYPES[name])
        extra = {k: v for k, v in record.items() if k not in KEYS}
        return cls(**values, extra=extra)

    def with_fields(self, **changes: Any) -> Declared:
        """A copy with ``changes`` (field names) applied."""
        return replace(self, **changes)

    def batch(self, num_examples: int) -> int:
        """Samples per batch: the declared ``batch_size``, else ``num_examples`` (one batch)."""
        return self.batch_size if self.batch_size is not None else num_examples


WIRE_KEYS: dict[str, str] = {
    f.name: ENCODING_KEY if f.name == "encoding" else f.name.replace("_", "-")
    for f in fields(Declared)
    if f.name != "extra"
}
"""Field name -> its key on the wire."""


def wire_key(name: str) -> str:
    """The wire key of field ``name`` (``batch_size`` -> ``batch-size``); ``KeyError`` for a name that is none."""
    return WIRE_KEYS[name]


KEYS = frozenset(WIRE_KEYS.values())
FIELD_TYPES: dict[str, type] = {
    "client": int,
    "protocol": str,
    "lr": float,
    "batch_size": int,
    "local_epochs": int,
    "local_steps": int,
    "loss": float,
    "proximal_mu": float,
    "labels": tuple,
    "encoding": str,
    "upload_bytes": int,
    "dense_bytes": int,
}


def _typed(name_on_wire: str, value: Any, kind: type) -> Any:
    """``value`` as ``kind``; ``ValueError`` naming ``name_on_wire`` when it is not one."""
    if kind is tuple:
        if isinstance(value, str):  # observation files written before labels travelled as a list: '3,1,4'
            value = [int(v) for v in value.split(",") if v.strip().lstrip("-").isdigit()]
        if isinstance(value, (list, tuple)) and all(_is_int(v) for v in value):
            return tuple(int(v) for v in value)
    elif kind is int:
        if _is_int(value):
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(value, str):
        return value
    expected = "a list of integers" if kind is tuple else kind.__name__
    raise ValueError(f"declared {name_on_wire} = {str(value)[:40]!r}: expected {expected}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
