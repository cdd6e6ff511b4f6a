"""What the server sees of one client upload.

An ``Observation`` holds exactly what an honest-but-curious server has: the
global model it sent (architecture, parameters and buffers), the upload it got
back, its kind, the number of examples and the hyper-parameters the client
declared. Never the client's data.

``meta()`` is what its file holds besides the arrays (``fedguard.store.observation_files`` writes and reads the
files).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedguard.data.registry import SourceOptions
from fedguard.data.spec import DataSpec
from fedguard.wire.declared import Declared

UPLOAD_KINDS = ("gradient", "weights")


@dataclass(frozen=True)
class Observation:
    """One captured upload.

    ``names``/``trainable``: the model's ``state_dict`` keys and which are
    parameters. ``global_arrays``: the state the client started from.
    ``upload``: one array per entry; for kind 'gradient' the parameter entries
    are batch gradients and the buffer entries the client's buffers after its
    step; for kind 'weights' all entries are the client's new state.
    ``declared``: what the client declared (and the server derived, in its ``extra``), typed; a mapping given
    here is read as one (``Declared.read``: ``ValueError`` for a value of the wrong type).
    ``manipulation``: what a malicious server did to the model it sent
    ('none' for an honest server; see ``attackers.manipulation``).
    """

    round: int
    client: int
    kind: str
    model: str
    model_params: dict[str, Any]
    spec: DataSpec
    names: tuple[str, ...]
    trainable: tuple[bool, ...]
    global_arrays: list[np.ndarray]
    upload: list[np.ndarray]
    num_examples: int
    declared: Declared = field(default_factory=Declared)
    manipulation: str = "none"

    def __post_init__(self) -> None:
        if not isinstance(self.declared, Declared):  # a mapping, as a file or a test gives it
            object.__setattr__(self, "declared", Declared.read(self.declared))
        if self.kind not in UPLOAD_KINDS:
            raise ValueError(f"kind {self.kind!r}: choose one of {', '.join(UPLOAD_KINDS)}")
        lengths = {len(self.names), len(self.trainable), len(self.global_arrays), len(self.upload)}
        if len(lengths) != 1:
            raise ValueError(f"names, trainable, global_arrays and upload differ in length: {sorted(lengths)}")

    def meta(self) -> dict[str, Any]:
        """Every field but the arrays, JSON-ready."""
        return {
            "round": self.round,
            "client": self.client,
            "kind": self.kind,
            "model": self.model,
            "model_params": self.model_params,
            "spec": [self.spec.channels, self.spec.height, self.spec.width, self.spec.num_classes],
            "names": list(self.names),
            "trainable": list(self.trainable),
            "num_examples": self.num_examples,
            "declared": self.declared.record(),
            "manipulation": self.manipulation,
        }


@dataclass(frozen=True)
class ModelCard:
    """What the server knows of the model it distributes: architecture, data shape, layout, and the data set the
    run draws its clients' data from (``data``: its name, '' when unknown; ``source``: how it loads), whose held-out
    split the server holds."""

    model: str
    model_params: dict[str, Any]
    spec: DataSpec
    names: tuple[str, ...]
    trainable: tuple[bool, ...]
    data: str = ""
    source: SourceOptions = SourceOptions()

    def observe(
        self,
        round_: int,
        client: int,
        kind: str,
        global_arrays: list[np.ndarray],
        upload: list[np.ndarray],
        num_examples: int,
        declared: Declared | Mapping[str, Any],
        manipulation: str = "none",
    ) -> Observation:
        """An ``Observation`` of one upload of this model."""
        return Observation(
            round=round_,
            client=client,
            kind=kind,
            model=self.model,
            model_params=self.model_params,
            spec=self.spec,
            names=self.names,
            trainable=self.trainable,
            global_arrays=global_arrays,
            upload=upload,
            num_examples=num_examples,
            declared=declared if isinstance(declared, Declared) else Declared.read(declared),
            manipulation=manipulation,
        )
