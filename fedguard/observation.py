"""What the server sees of one client upload, and its on-disk format.

An ``Observation`` holds exactly what an honest-but-curious server has: the
global model it sent (architecture, parameters and buffers), the upload it got
back, its kind, the number of examples and the hyper-parameters the client
declared. Never the client's data.

On disk one observation is one ``.npz`` file (no pickles): arrays
``global/<i>`` and ``upload/<i>`` for the i-th ``state_dict`` entry, and
``meta``, a JSON string with every other field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedguard.data.registry import SourceOptions
from fedguard.data.spec import DataSpec
from fedguard.store.folder import UPLOAD_GLOB, replacing, upload_file_name
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
    declared: dict[str, Any] = field(default_factory=dict)
    manipulation: str = "none"

    def __post_init__(self) -> None:
        if self.kind not in UPLOAD_KINDS:
            raise ValueError(f"kind {self.kind!r}: choose one of {', '.join(UPLOAD_KINDS)}")
        lengths = {len(self.names), len(self.trainable), len(self.global_arrays), len(self.upload)}
        if len(lengths) != 1:
            raise ValueError(f"names, trainable, global_arrays and upload differ in length: {sorted(lengths)}")

    @property
    def declaration(self) -> Declared:
        """What the client declared (and the server derived), typed; ``ValueError`` for a value of the wrong type."""
        return Declared.read(self.declared)

    @property
    def file_name(self) -> str:
        """``round-RRRR_client-CCCC.npz``."""
        return upload_file_name(self.round, self.client)

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
            "declared": self.declared,
            "manipulation": self.manipulation,
        }


def save_observation(obs: Observation, folder: Path) -> Path:
    """Write ``obs`` to ``folder/obs.file_name`` atomically; returns the path."""
    arrays = {f"global/{i}": a for i, a in enumerate(obs.global_arrays)}
    arrays.update({f"upload/{i}": a for i, a in enumerate(obs.upload)})
    target = folder / obs.file_name
    with replacing(target, sync=False) as handle:
        # mypy takes **arrays for a value of the keyword-only allow_pickle (a bool)
        np.savez(handle, meta=np.array(json.dumps(obs.meta())), **arrays)  # type: ignore[arg-type]
    return target


def load_observation(path: Path) -> Observation:
    """Read an observation written by ``save_observation``."""
    with np.load(path, allow_pickle=False) as archive:
        meta = json.loads(str(archive["meta"]))
        count = len(meta["names"])
        global_arrays = [archive[f"global/{i}"] for i in range(count)]
        upload = [archive[f"upload/{i}"] for i in range(count)]
    return Observation(
        round=meta["round"],
        client=meta["client"],
        kind=meta["kind"],
        model=meta["model"],
        model_params=meta["model_params"],
        spec=DataSpec(*meta["spec"]),
        names=tuple(meta["names"]),
        trainable=tuple(meta["trainable"]),
        global_arrays=global_arrays,
        upload=upload,
        num_examples=meta["num_examples"],
        declared=meta["declared"],
        manipulation=meta.get("manipulation", "none"),
    )


def load_observations(folder: Path) -> list[Observation]:
    """Every observation in ``folder``, ordered by round then client."""
    return [load_observation(p) for p in sorted(Path(folder).glob(UPLOAD_GLOB))]


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
        declared: dict[str, Any],
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
            declared=declared,
            manipulation=manipulation,
        )
