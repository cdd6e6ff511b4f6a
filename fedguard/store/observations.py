"""Captured uploads read back from a run folder as untrusted files (``fedguard attack``, ``fedguard train-mjolnir
--at``).

Whoever could write the run folder could have altered an observation file (``fedguard.observation``), so
``read_observation`` checks it against the run (``RunExpectations``: the model card, the run's rounds and clients,
and what a client may declare) before anything it declares is allocated or decompressed. The first problem raises
``ObservationRefused``, whose message names the file and the problem:

- where it is: a regular file in the run folder, not a symbolic link (nothing outside the run folder is read),
  named ``round-RRRR_client-CCCC.npz`` for the round and client its meta declares, so that no two files hold the
  same upload;
- the archive: a zip whose members are ``meta`` and ``global/<i>``, ``upload/<i>`` for each of the model's
  ``state_dict`` entries, nothing else, stored or deflated; sizes from the zip directory (each member's
  ``file_size``, before decompressing) and the ``.npy`` headers (``numpy.lib.format``, without reading the data):
  ``meta`` a 0-d string of at most ``MAX_META_BYTES``, each array the card's shape and dtype, its member exactly
  the bytes of that header and that data;
- the meta: each field of its type; the model, its parameters, the data shape and the ``state_dict`` layout the
  card's; the kind the run's protocol's; round in [1, train.rounds] and client in [0, partition.num-clients);
  the number of examples and what the client declared checked as the server checks a live upload
  (``strategies.upload_checks.check_declared``: partition and ``train.*`` sizes, types);
- the arrays: finite.

The ``Observation`` returned carries the card's model description, never the file's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import stat
import zipfile
from pathlib import Path
from typing import IO, Any

import numpy as np
from numpy.lib import format as npy

from attackers.manipulation import HONEST, MANIPULATIONS
from fedguard.aggregate import AGGREGATE_CLIENT, AGGREGATE_KEY
from fedguard.config import Config
from fedguard.limits import MAX_META_BYTES, shown
from fedguard.observation import UPLOAD_KINDS, ModelCard, Observation
from fedguard.protocols import protocol as run_protocol
from fedguard.store.card import initial_model, model_card, upload_rules
from fedguard.store.folder import upload_file_name
from fedguard.trained.files import READ_ERRORS, NonFiniteMeta, reject_constant
from fedguard.training import get_arrays
from fedguard.wire.declared import wire_key
from fedguard.wire.records import PROXIMAL_MU_KEY
from strategies.upload_checks import (
    NPY_HEADERS,
    Layout,
    UploadRefused,
    UploadRules,
    check_declared,
    expect_equal,
    is_integer,
    is_real,
    nonfinite_problem,
)

FILE_NAME = re.compile(r"round-\d+_client-\d+\.npz")
COMPRESSIONS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)  # what np.savez and np.savez_compressed write
META = "meta"


class ObservationRefused(ValueError):
    """An observation file that is not used; the message names it and why."""


@dataclasses.dataclass(frozen=True)
class RunExpectations:
    """What a captured upload of a run must be: the model ``card`` and its array ``layout``, the upload ``kind``,
    the run's ``rounds``, the ``rules`` of what a client may declare, and the train config the server sent
    (``instruction``: FedProx's ``proximal-mu``)."""

    card: ModelCard
    layout: Layout
    kind: str
    rounds: int
    rules: UploadRules
    instruction: dict[str, Any]

    @classmethod
    def of(cls, config: Config) -> RunExpectations:
        """The expectations of the run ``config`` describes (loads its dataset, builds its model)."""
        model = initial_model(config)
        card = model_card(config, model)
        mu = getattr(config.strategy.params, "proximal_mu", None)
        return cls(
            card,
            Layout.of(card.names, get_arrays(model)),
            run_protocol(config.train.protocol).upload_kind,
            config.train.rounds,
            upload_rules(config, card),
            {} if mu is None else {PROXIMAL_MU_KEY: mu},
        )


def read_observation(path: Path, run_dir: Path, expected: RunExpectations) -> Observation:
    """The observation in the file at ``path`` inside ``run_dir``, checked against ``expected``;
    ``ObservationRefused`` naming the file and the first problem."""
    try:
        with _open_inside(Path(path), Path(run_dir)) as handle:
            return _read(Path(path).name, handle, expected)
    except ObservationRefused as refused:
        raise ObservationRefused(f"{path}: {refused}") from None
    except (UploadRefused, NonFiniteMeta) as problem:
        raise ObservationRefused(f"{path}: {problem}") from None
    except READ_ERRORS as error:
        raise ObservationRefused(f"{path}: unreadable ({type(error).__name__}: {error})") from None


def _open_inside(path: Path, run_dir: Path) -> IO[bytes]:
    """``path`` opened for reading: a regular file, not a symbolic link, inside ``run_dir``."""
    if not FILE_NAME.fullmatch(path.name):
        raise ObservationRefused("not named round-RRRR_client-CCCC.npz")
    if not path.parent.resolve().is_relative_to(run_dir.resolve()):
        raise ObservationRefused(f"outside the run folder {run_dir}; not read")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        if path.is_symlink():
            raise ObservationRefused(
                "a symbolic link; observations are read only from files in the run folder"
            ) from None
        raise
    handle = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        handle.close()
        raise ObservationRefused("not a regular file")
    return handle


def _read(name: str, handle: IO[bytes], expected: RunExpectations) -> Observation:
    """The observation in the open archive ``handle`` of the file called ``name``."""
    with zipfile.ZipFile(handle) as archive:
        members = _members(archive, len(expected.card.names))
        meta = _read_meta(archive, members[META])
        fields = _described(name, meta, expected)
        arrays = {
            key: _read_array(archive, info, _layout_entry(key, expected.layout))
            for key, info in members.items()
            if key != META
        }
    count = len(expected.card.names)
    global_arrays = [arrays[f"global/{i}"] for i in range(count)]
    upload = [arrays[f"upload/{i}"] for i in range(count)]
    problem = nonfinite_problem(
        [f"global/{i}" for i in range(count)] + [f"upload/{i}" for i in range(count)], global_arrays + upload
    )
    if problem is not None:
        raise ObservationRefused(problem)
    return Observation(**fields, global_arrays=global_arrays, upload=upload)


def _members(archive: zipfile.ZipFile, count: int) -> dict[str, zipfile.ZipInfo]:
    """Member key (``meta``, ``global/<i>``, ``upload/<i>``) -> its zip entry; exactly those of a model with
    ``count`` entries, each once, stored or deflated."""
    infos = archive.infolist()
    expected = {META} | {f"{part}/{i}" for part in ("global", "upload") for i in range(count)}
    found = [info.filename.removesuffix(".npy") for info in infos]
    if len(set(found)) != len(found):
        raise ObservationRefused(f"the archive holds a member twice ({len(found)} entries, {len(set(found))} names)")
    if set(found) != expected:
        odd = sorted(set(found) - expected)[:3]
        missing = sorted(expected - set(found))[:3]
        raise ObservationRefused(
            f"the archive holds other members than meta, global/<i> and upload/<i> for the "
            f"model's {count} entries (unexpected {shown(odd)}, missing {shown(missing)})"
        )
    for info in infos:
        if info.compress_type not in COMPRESSIONS:
            raise ObservationRefused(
                f"member {info.filename!r} uses compression method {info.compress_type}; "
                "expected stored or deflated (np.savez, np.savez_compressed)"
            )
    return dict(zip(found, infos))


def _layout_entry(key: str, layout: Layout) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of member ``key`` (``global/<i>`` or ``upload/<i>``): the model's entry i."""
    index = int(key.rpartition("/")[2])
    return layout.shapes[index], layout.dtypes[index]


def _header(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, bytes the member holds by its header) of a ``.npy`` member, from its header alone."""
    with archive.open(info) as stream:
        read = NPY_HEADERS.get(npy.read_magic(stream))
        if read is None:
            raise ObservationRefused(f"member {info.filename!r} is a .npy of a format other than 1.0 and 2.0")
        shape, _, dtype = read(stream)
        return tuple(shape), dtype, stream.tell() + math.prod(shape) * dtype.itemsize


def _checked_header(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, shape: tuple[int, ...], dtype: np.dtype | str
) -> None:
    """The member's header names ``shape`` and ``dtype`` (a string: a dtype of that kind, e.g. ``"U"``), and
    its declared size (``file_size``) is exactly the bytes that header says."""
    found_shape, found_dtype, size = _header(archive, info)
    if (found_dtype.kind if isinstance(dtype, str) else found_dtype) != dtype:
        raise ObservationRefused(f"member {info.filename!r} is {found_dtype}, expected {dtype}")
    if found_shape != shape:
        raise ObservationRefused(f"member {info.filename!r} has shape {shown(found_shape)}, expected {shape}")
    if info.file_size != size:
        raise ObservationRefused(
            f"member {info.filename!r} declares {info.file_size} bytes, but its header "
            f"({found_dtype} {found_shape}) makes {size}"
        )


def _read_array(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, expected: tuple[tuple[int, ...], np.dtype]
) -> np.ndarray:
    """A model array member, once its header and size are the model's."""
    shape, dtype = expected
    _checked_header(archive, info, shape, dtype)
    with archive.open(info) as stream:
        return npy.read_array(stream, allow_pickle=False)


def _read_meta(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> dict[str, Any]:
    """The JSON object of the ``meta`` member, at most ``MAX_META_BYTES``, every number finite."""
    if info.file_size > MAX_META_BYTES:
        raise ObservationRefused(
            f"its meta declares {info.file_size} bytes, more than the {MAX_META_BYTES} a meta may hold"
        )
    _checked_header(archive, info, (), "U")
    with archive.open(info) as stream:
        text = str(npy.read_array(stream, allow_pickle=False))
    try:
        meta = json.loads(text, parse_constant=reject_constant)
    except NonFiniteMeta as constant:
        raise ObservationRefused(f"its meta holds the non-finite number {constant}") from None
    except ValueError as error:
        raise ObservationRefused(f"its meta is not valid JSON ({error})") from None
    if not isinstance(meta, dict):
        raise ObservationRefused(f"its meta is a JSON {type(meta).__name__}, not an object")
    return meta


def _field(meta: dict[str, Any], key: str, valid: bool, what: str) -> Any:
    """``meta[key]`` when ``valid`` (its check on that value), else ``ObservationRefused`` saying ``what`` it
    must be."""
    if key not in meta:
        raise ObservationRefused(f"its meta lacks {key!r}")
    if not valid:
        raise ObservationRefused(f"meta {key} = {shown(meta[key])}: expected {what}")
    return meta[key]


def _integer_in(meta: dict[str, Any], key: str, low: int, high: int, what: str) -> int:
    """``meta[key]``, an integer in [``low``, ``high``]; ``what`` the bound is."""
    value = meta.get(key)
    return _field(meta, key, is_integer(value) and low <= value <= high, f"an integer in [{low}, {high}] ({what})")


def _described(name: str, meta: dict[str, Any], expected: RunExpectations) -> dict[str, Any]:
    """The fields of the observation ``meta`` describes but its arrays, each checked against ``expected``."""
    card, rules = expected.card, expected.rules
    round_ = _integer_in(meta, "round", 1, expected.rounds, "train.rounds")
    aggregate = meta.get("client") == AGGREGATE_CLIENT
    client = (
        AGGREGATE_CLIENT
        if aggregate
        else _integer_in(meta, "client", 0, len(rules.partition_sizes) - 1, "partition.num-clients")
    )
    if name != upload_file_name(round_, client):
        raise ObservationRefused(
            f"its meta declares round {round_}, client {client}, whose file is {upload_file_name(round_, client)}"
        )
    _field(
        meta,
        "kind",
        meta.get("kind") == expected.kind,
        f"{expected.kind!r}, the upload of train.protocol = {rules.protocol!r} (of {', '.join(UPLOAD_KINDS)})",
    )
    model = {
        "model": card.model,
        "model_params": card.model_params,
        "spec": [card.spec.channels, card.spec.height, card.spec.width, card.spec.num_classes],
        "names": list(card.names),
        "trainable": list(card.trainable),
    }
    for key, value in model.items():
        _field(meta, key, _same_json(meta.get(key), value), f"{shown(value)}, the run's")
    manipulations = [HONEST, *MANIPULATIONS.names()]
    manipulation = meta.get("manipulation", HONEST)
    if not isinstance(manipulation, str) or manipulation not in manipulations:
        raise ObservationRefused(
            f"meta manipulation = {shown(manipulation)}: expected one of {', '.join(manipulations)}"
        )
    declared = _field(meta, "declared", isinstance(meta.get("declared"), dict), "a JSON object")
    if aggregate:
        num_examples = _check_aggregate(meta, rules, declared)
    else:
        num_examples = _integer_in(
            meta,
            "num_examples",
            1,
            rules.partition_sizes[client],
            f"client {client} holds {rules.partition_sizes[client]} samples",
        )
        _check_declared(rules, client, num_examples, declared, expected)
    return {
        "round": round_,
        "client": client,
        "kind": expected.kind,
        "model": card.model,
        "model_params": card.model_params,
        "spec": card.spec,
        "names": card.names,
        "trainable": card.trainable,
        "num_examples": num_examples,
        "declared": declared,
        "manipulation": manipulation,
    }


def _check_aggregate(meta: dict[str, Any], rules: UploadRules, declared: dict[str, Any]) -> int:
    """The example count of a secure aggregate (``fedguard.aggregate``), checked with what it declares: distinct
    client ids of the run, at most their samples, and the run's protocol, learning rate and local epochs."""
    clients = declared.get(AGGREGATE_KEY)
    if not (
        isinstance(clients, list)
        and 0 < len(clients) == len(set(map(str, clients)))
        and all(is_integer(c) and 0 <= c < len(rules.partition_sizes) for c in clients)
    ):
        raise ObservationRefused(
            f"declared {AGGREGATE_KEY} = {shown(clients)}: expected distinct client ids below "
            f"{len(rules.partition_sizes)} (an aggregate's clients)"
        )
    holds = sum(rules.partition_sizes[c] for c in clients)
    count = _integer_in(meta, "num_examples", 1, holds, f"clients {shown(clients)} hold {holds} samples")
    expect_equal(declared, wire_key("protocol"), rules.protocol, "the run's train.protocol")
    expect_equal(declared, wire_key("lr"), rules.lr, "the run's train.lr")
    expect_equal(declared, wire_key("local_epochs"), rules.local_epochs, "the run's train.local-epochs")
    return count


def _same_json(found: Any, expected: Any) -> bool:
    """Whether ``found`` is ``expected`` as JSON writes it (``True`` is not 1)."""
    return json.dumps(found, sort_keys=True) == json.dumps(expected, sort_keys=True)


def _check_declared(
    rules: UploadRules, client: int, num_examples: int, declared: dict[str, Any], expected: RunExpectations
) -> None:
    """What the client declared, checked as the server checks a live upload, and the types of what the server
    records besides."""
    check_declared(rules, client, num_examples, declared, expected.instruction)
    loss, upload_bytes = declared.get(wire_key("loss")), declared.get(wire_key("upload_bytes"))
    if loss is not None and not is_real(loss):
        raise ObservationRefused(f"declared {wire_key('loss')} = {shown(loss)}: expected a number")
    if upload_bytes is not None and not (is_integer(upload_bytes) and upload_bytes >= 0):
        raise ObservationRefused(
            f"declared {wire_key('upload_bytes')} = {shown(upload_bytes)}: expected an integer >= 0"
        )
    expect_equal(declared, wire_key("dense_bytes"), expected.layout.nbytes, "the model's bytes, dense")
