"""One client can neither stop nor poison the federation: each finding of a hostile client, reproduced.

Rounds are driven in process: ``RoundGuard`` over the capture and FedSGD with replies built as the ClientApp
builds them (``tests.helpers.reply``) on a grid of node ids 100, 101, 102 (clients 0, 1, 2), and whole runs of
``run_server`` on a ``LocalGrid`` whose ClientApp is honest but for one node.
"""

from __future__ import annotations

import errno
import html
import io
import json
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

import fedguard.wire.records
from fedguard.config import Config
from fedguard.data import DataSpec
from fedguard.observation import ModelCard
from fedguard.report.run_status import read_status
from fedguard.runtime.client_app import make_client_app
from fedguard.runtime.server_app import make_server_app, round_accounting, run_server
from fedguard.selection import Selection
from fedguard.store.checkpoint import read_checkpoint
from fedguard.store.folder import CHECKPOINT_FILE, ROUNDS_FILE, RunFileUnwritable
from fedguard.store.rows import read_rounds
from fedguard.wire.records import ARRAYS, array_record
from fedguard.wire.sparse import ENCODING_KEY, SPARSE, decode_arrays, encode_arrays
from strategies import FedSGD, HonestButCurious, RoundGuard, SparseUploads
from strategies.round_guard import assign_clients
from strategies.upload_checks import (
    Layout,
    NonFiniteModel,
    UploadRefused,
    UploadRules,
    check_declared,
    check_header,
    check_positions,
    check_sparse,
    nonfinite_problem,
)
from tests.helpers import ListSink, Nodes, config, reply
from tests.hostile_defense import SLOW_SECONDS
from tests.local_grid import LocalGrid

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("w", "b", "n")
CARD = ModelCard("mlp", {"hidden": 2, "depth": 0}, DataSpec(1, 2, 2, 10), NAMES, (True, True, False))
RULES = UploadRules("fedsgd", lr=0.1, batch_size=8, local_epochs=1, num_classes=10, partition_sizes=(20, 20, 20))
LAYOUT = Layout(NAMES, ((2, 4), (2,), ()), (np.dtype(np.float32), np.dtype(np.float32), np.dtype(np.int64)))


def model() -> list[np.ndarray]:
    return [np.zeros((2, 4), np.float32), np.zeros(2, np.float32), np.array(0, np.int64)]


def upload(client: Any, value: float = 1.0, **declared: Any) -> tuple[list[np.ndarray], int, dict[str, Any]]:
    """An honest-looking upload: every gradient entry ``value``, one batch of 8."""
    arrays = [np.full((2, 4), value, np.float32), np.full(2, value, np.float32), np.array(1, np.int64)]
    return arrays, 8, {"client": client, "batch-size": 8, "lr": 0.1, **declared}


def play(
    uploads: list[tuple[list[np.ndarray], int, dict[str, Any]]],
    extra: Callable[[list[Message]], list[Message]] = lambda replies: replies,
):
    """Round 1 of the guarded, capturing FedSGD server on ``len(uploads)`` nodes answering ``uploads`` in node
    order (``extra`` may add replies): the new model's arrays (None when skipped), the round's row entries,
    the observations."""
    sink, row = ListSink(), {}
    capture = HonestButCurious(
        FedSGD(lr=0.1, trainable=CARD.trainable, min_train_nodes=len(uploads), min_available_nodes=len(uploads)),
        sink,
        CARD,
        "gradient",
        Selection.parse("all"),
        Selection.parse("all"),
    )
    guard = RoundGuard(SparseUploads(capture), round_accounting(row), RULES)
    sent = sorted(
        guard.configure_train(1, array_record(NAMES, model()), ConfigRecord(), Nodes(len(uploads))),
        key=lambda m: m.metadata.dst_node_id,
    )
    aggregated, _ = guard.aggregate_train(1, extra([reply(m, *u) for m, u in zip(sent, uploads)]))
    return None if aggregated is None else aggregated.to_numpy_ndarrays(), row, sink.items


def honest_step(*values: float) -> np.ndarray:
    """The new ``w`` after one FedSGD step of lr 0.1 from 0 on uploads of these values."""
    return np.full((2, 4), -0.1 * np.mean(values), np.float32)


def test_clients_are_assigned_in_node_order_and_each_instruction_names_its_own() -> None:
    assert assign_clients([102, 7, 55]) == {7: 0, 55: 1, 102: 2}
    guard = RoundGuard(FedSGD(lr=0.1, trainable=CARD.trainable, min_train_nodes=3), lambda *a: None, RULES)
    sent = guard.configure_train(1, array_record(NAMES, model()), ConfigRecord(), Nodes(3))
    assert sorted((m.metadata.dst_node_id, m.content["config"]["partition-id"]) for m in sent) == [
        (100, 0),
        (101, 1),
        (102, 2),
    ]


def test_honest_uploads_are_all_accepted() -> None:
    new, row, observations = play([upload(0), upload(1), upload(2, 4.0)])
    assert np.allclose(new[0], honest_step(1, 1, 4)) and "rejected" not in row and row["clients"] == 3
    assert [o.client for o in observations] == [0, 1, 2]


@pytest.mark.parametrize(
    "names, bad, reason",
    [
        (
            NAMES,
            [np.ones((4, 2), np.float32), np.ones(2, np.float32), np.array(1)],
            "array 'w' has shape (4, 2), expected (2, 4)",
        ),
        (
            NAMES,
            [np.ones((2, 4), np.float64), np.ones(2, np.float32), np.array(1)],
            "array 'w' is float64, expected float32",
        ),
        (
            NAMES[:2],
            [np.ones((2, 4), np.float32), np.ones(2, np.float32)],
            "uploads 2 arrays ['w', 'b'], expected the model's 3 ['w', 'b', 'n']",
        ),
    ],
)
def test_a_malformed_upload_is_rejected_and_the_round_goes_on(
    names: tuple[str, ...], bad: list[np.ndarray], reason: str
) -> None:
    # Before: a wrong shape aborted the run in round 1 with a message naming neither client nor array.
    def malformed(replies: list[Message]) -> list[Message]:
        replies[1].content[ARRAYS] = array_record(names, bad)
        return replies

    new, row, observations = play([upload(0), upload(1), upload(2)], malformed)
    assert row["rejected"] == [{"client": 1, "reason": reason}] and row["clients"] == 2
    assert np.allclose(new[0], honest_step(1, 1)) and [o.client for o in observations] == [0, 2]


def test_a_declared_id_that_is_not_an_integer_is_rejected() -> None:
    new, row, _ = play([upload(0), upload("abc"), upload(2)])
    assert row["rejected"] == [{"client": 1, "reason": "declares client 'abc', but its node is client 1"}]
    assert np.allclose(new[0], honest_step(1, 1))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_non_finite_upload_is_rejected_and_the_model_stays_finite(value: float) -> None:
    # Before: one NaN upload made the global model NaN from round 1, and the run exited 0.
    arrays, n, declared = upload(1)
    arrays[1][0] = value
    new, row, _ = play([upload(0), (arrays, n, declared), upload(2)])
    assert row["rejected"] == [{"client": 1, "reason": "array 'b' holds 1 NaN or infinite entries of 2"}]
    assert all(np.isfinite(a).all() for a in new) and np.allclose(new[0], honest_step(1, 1))


def test_a_client_declaring_another_ones_id_is_rejected_and_the_real_observation_kept() -> None:
    # Before: node 102 declaring client 0 overwrote client 0's observation, scored against client 0's batch.
    new, row, observations = play([upload(0, 1.0), upload(1, 2.0), upload(0, 9.0)])
    assert row["rejected"] == [{"client": 2, "reason": "declares client 0, but its node is client 2"}]
    assert [(o.round, o.client) for o in observations] == [(1, 0), (1, 1)]
    assert np.all(observations[0].upload[0] == 1.0) and np.allclose(new[0], honest_step(1, 2))


def test_a_second_upload_from_one_node_is_rejected() -> None:
    def twice(replies: list[Message]) -> list[Message]:
        again = Message(replies[0].content, reply_to=replies[0])
        again.metadata.__dict__["_src_node_id"] = replies[0].metadata.src_node_id
        return [*replies, again]

    _, row, observations = play([upload(0), upload(1)], twice)
    assert row["rejected"] == [{"client": 0, "reason": "node 100 sent an upload it was not asked for this round"}]
    assert [o.client for o in observations] == [0, 1]


@pytest.mark.parametrize(
    "num_examples, declared, reason",
    [
        (
            8,
            {"batch-size": 10**7},
            "declares batch-size = 10000000, expected an integer in [1, 8] (train.batch-size = 8, num-examples = 8)",
        ),
        (10**7, {"batch-size": 10**7}, "num-examples = 10000000: client 1 holds 20 samples"),
        (8, {"labels": list(range(10**4))}, "declares labels [0, 1, 2, 3, 4, 5, ...], expected a list of 8 classes"),
        (8, {"lr": 100.0}, "declares lr = 100.0, expected 0.1 (the run's train.lr)"),
    ],
)
def test_absurd_declared_sizes_are_rejected(num_examples: int, declared: dict[str, Any], reason: str) -> None:
    # Before: a declared batch of 10**7 stalled every attack grouped with the upload.
    arrays, _, honest = upload(1)
    _, row, observations = play([upload(0), (arrays, num_examples, {**honest, **declared}), upload(2)])
    assert row["rejected"] == [{"client": 1, "reason": reason}] and [o.client for o in observations] == [0, 2]


def test_a_round_whose_every_upload_is_rejected_is_skipped_with_the_reason() -> None:
    new, row, observations = play([upload(1), upload(0)])
    assert new is None and observations == [] and row["clients"] == 0
    assert row["skipped"] == "every upload was rejected (2); the model is unchanged"


def test_a_sparse_upload_is_checked_against_the_formats_invariants() -> None:
    arrays, n, declared = upload(1)
    arrays[0][0] = 0.0
    _, row, observations = play([upload(0), (encode_arrays(arrays), n, {**declared, ENCODING_KEY: SPARSE})])
    assert "rejected" not in row and np.array_equal(observations[1].upload[0], arrays[0])

    parts = encode_arrays(arrays)
    wrong_shape = [*parts[:2], np.array([4, 2], np.int64), *parts[3:]]
    beyond = [np.array([0, 8], np.int32), np.ones(2, np.float32), *parts[2:]]
    assert parts[3].dtype == np.uint8 and parts[3].tolist() == [0b1100_0000]  # b: 2 of 2 entries, a 1-byte mask
    padded = [*parts[:3], np.array([0b1110_0000], np.uint8), np.ones(3, np.float32), *parts[5:]]
    overcounted = [*parts[:3], parts[3], np.ones(3, np.float32), *parts[5:]]
    long_mask = [*parts[:3], np.array([0b1100_0000, 0], np.uint8), *parts[4:]]
    for bad, reason in [
        (wrong_shape, "array 'w' is encoded with the shape (4, 2), expected (2, 4)"),
        (beyond, "array 'w' is encoded with positions that are not strictly increasing in [0, 8)"),
        (padded, "array 'b' is encoded with a bad mask: the mask's padding bits past entry 2 must be zero"),
        (overcounted, "array 'b (values)' has shape (3,), expected (2,)"),
        (
            long_mask,
            "array 'b' is encoded with positions uint8 (2,), expected int32 (k,) with k <= 2 or a uint8 mask (1,)",
        ),
        (parts[:-1], "uploads 8 encoded arrays, expected 3 per model array: 9"),
    ]:
        _, row, _ = play([upload(0), (bad, n, {**declared, ENCODING_KEY: SPARSE})])
        assert row["rejected"] == [{"client": 1, "reason": reason}]


def test_a_sparse_upload_is_decoded_once_on_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[int] = []

    def counted(parts: list[np.ndarray]) -> list[np.ndarray]:
        decoded.append(len(parts))
        return decode_arrays(parts)

    monkeypatch.setattr(fedguard.wire.records, "decode_arrays", counted)
    arrays, n, declared = upload(1)
    arrays[0][0] = 0.0
    new, row, observations = play([upload(0), (encode_arrays(arrays), n, {**declared, ENCODING_KEY: SPARSE})])
    assert decoded == [3 * len(NAMES)], "the guard decodes it; the capture and the aggregation read it dense"
    assert np.array_equal(observations[1].upload[0], arrays[0]) and observations[1].declared.encoding is None
    assert "rejected" not in row and np.allclose(new[0], -0.1 * (1.0 + arrays[0]) / 2)


def claimed(shape: tuple[int, ...], dtype: str = "<f4") -> Array:
    """An ``Array`` whose ``.npy`` header claims ``shape`` and that holds no data."""
    stream = io.BytesIO()
    np.lib.format.write_array_header_1_0(stream, {"descr": dtype, "fortran_order": False, "shape": shape})
    return Array(dtype="float32", shape=shape, stype="numpy.ndarray", data=stream.getvalue())


def test_a_claimed_size_is_refused_from_the_header_before_anything_is_loaded() -> None:
    with pytest.raises(UploadRefused, match=r"array 'w' has shape \(1000000000000,\), expected \(2, 4\)"):
        check_header("w", claimed((10**12,)), (2, 4), np.dtype(np.float32))
    sparse = {f"encoded-{i}": claimed((10**12,), "<i4") for i in range(9)}
    with pytest.raises(UploadRefused, match=r"array 'w \(shape\)' is int32, expected int64"):
        check_sparse(LAYOUT, ArrayRecord(array_dict=sparse))
    with pytest.raises(UploadRefused, match="positions that are not strictly increasing"):
        check_positions("w", np.array([3, 3], np.int32), 8)


def test_a_local_schedule_must_be_the_runs() -> None:
    fedavg = UploadRules("fedavg", lr=0.1, batch_size=8, local_epochs=2, num_classes=10, partition_sizes=(20,))
    honest = {"batch-size": 8, "local-epochs": 2, "local-steps": 6}  # 2 epochs of ceil(20 / 8) batches
    check_declared(fedavg, 0, 20, honest, {})
    with pytest.raises(UploadRefused, match=r"declares local-steps = 1000000000, expected 6 \(2 epochs of 3"):
        check_declared(fedavg, 0, 20, {**honest, "local-steps": 10**9}, {})
    with pytest.raises(UploadRefused, match=r"declares proximal-mu = 5.0, expected 0.01 \(the value the server"):
        check_declared(fedavg, 0, 20, {**honest, "proximal-mu": 5.0}, {"proximal-mu": 0.01})


def test_nonfinite_problem_names_the_array() -> None:
    assert (
        nonfinite_problem(["a", "b"], [np.ones(2), np.array([1, np.nan, np.inf])])
        == "array 'b' holds 2 NaN or infinite entries of 3"
    )
    assert nonfinite_problem(["a"], [np.ones(2)]) is None


def hostile(grid: LocalGrid, nodes: set[int], edit: Callable[[list[np.ndarray]], list[np.ndarray]]) -> LocalGrid:
    """``grid`` whose ClientApp on ``nodes`` replaces its honest upload's arrays by ``edit(arrays)``."""
    honest = grid.client_app

    def client_app(message: Message, context: Context) -> Message:
        answer = honest(message, context)
        if context.node_id in nodes:
            record = answer.content[ARRAYS]
            answer.content[ARRAYS] = array_record(list(record.keys()), edit(record.to_numpy_ndarrays()))
        return answer

    grid.client_app = client_app
    return grid


def run_with(tmp_path: Path, nodes: set[int], fill: float) -> Path:
    """A run of 2 rounds of 4 clients in which the float arrays uploaded by ``nodes`` are all ``fill``."""
    cfg = config("train.rounds=2", "train.clients-per-round=4", "capture.rounds=none", f"out-dir={tmp_path / 'run'}")
    grid = LocalGrid(make_client_app(cfg), cfg.partition.num_clients)
    run_server(
        hostile(grid, nodes, lambda arrays: [np.full_like(a, fill) if a.dtype.kind == "f" else a for a in arrays]), cfg
    )
    return tmp_path / "run"


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines()]


def test_a_run_with_a_client_uploading_nan_trains_on_the_others(tmp_path: Path) -> None:
    folder = run_with(tmp_path, {102}, np.nan)
    assert read_status(folder)["status"] == "completed"
    got = rows(folder)
    assert [r["round"] for r in got] == [0, 1, 2] and got[2]["loss"] < got[0]["loss"]
    for row in got[1:]:
        assert row["clients"] == 3 and [r["client"] for r in row["rejected"]] == [2]
        assert "NaN or infinite" in row["rejected"][0]["reason"]


@pytest.mark.filterwarnings("ignore:overflow encountered")
def test_a_global_model_turning_non_finite_stops_the_run(tmp_path: Path) -> None:
    # Two finite uploads near float32's largest value: their mean overflows to infinity.
    with pytest.raises(NonFiniteModel, match=r"round 1: after aggregation the global model's array '.+' holds"):
        run_with(tmp_path, {100, 101}, 3e38)
    folder = tmp_path / "run"
    status = read_status(folder)
    assert status["status"] == "failed" and "NonFiniteModel" in status["error"]
    last = rows(folder)[-1]
    assert last["round"] == 1 and last["stopped"].startswith("the global model's array '")


def serve(cfg: Config, grid: LocalGrid) -> None:
    """Call the ServerApp of ``cfg`` on ``grid`` as Flower calls it."""
    context = Context(run_id=1, node_id=0, state=RecordDict(), run_config={}, node_config={})
    make_server_app(cfg)(grid=grid, context=context)


def test_every_client_failing_ends_the_serverapp_failed_naming_them_without_a_traceback(tmp_path: Path) -> None:
    cfg = config("train.rounds=2", "capture.rounds=none", f"out-dir={tmp_path / 'run'}")
    serve(cfg, LocalGrid(make_client_app(cfg), cfg.partition.num_clients, fail={0, 1, 2, 3}))  # returns: explained
    status = read_status(tmp_path / "run")
    assert status["status"] == "failed" and status["error"].startswith("AllClientsFailed: round 1: every one of 3")
    assert "RuntimeError: this client fails" in status["error"]


def failing_writes(monkeypatch: pytest.MonkeyPatch, name: str, call: int, code: int) -> None:
    """``os.write`` and ``os.fsync`` on a file whose name holds ``name`` fail with ``code`` at the ``call``-th of
    them (a write having given half its bytes to the file first, as a disk filling mid-line does)."""
    real_write, real_fsync, calls = os.write, os.fsync, [0]

    def failing(fd: int) -> bool:
        if name not in os.path.basename(os.readlink(f"/proc/self/fd/{fd}")):
            return False
        calls[0] += 1
        return calls[0] == call

    def write(fd: int, data: bytes) -> int:
        if failing(fd):
            real_write(fd, data[: len(data) // 2])
            raise OSError(code, os.strerror(code))
        return real_write(fd, data)

    def fsync(fd: int) -> None:
        if failing(fd):
            raise OSError(code, os.strerror(code))
        real_fsync(fd)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize(
    ("name", "code"),
    [
        (ROUNDS_FILE, errno.ENOSPC),
        (ROUNDS_FILE, errno.EFBIG),
        (ROUNDS_FILE, errno.EROFS),
        (CHECKPOINT_FILE, errno.EDQUOT),
    ],
)
def test_a_disk_filling_mid_run_ends_it_failed_naming_the_file_and_keeps_every_whole_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, code: int
) -> None:
    """The second write of ``name`` fails: round 1's row (half of it written first), or round 1's checkpoint."""
    folder = tmp_path / "run"
    cfg = config("train.rounds=3", "capture.rounds=none", f"out-dir={folder}")
    grid = LocalGrid(make_client_app(cfg), cfg.partition.num_clients)
    failing_writes(monkeypatch, name, call=2, code=code)
    with pytest.raises(RunFileUnwritable) as raised:
        run_server(grid, cfg)
    message = rf"cannot write {re.escape(str(folder / name))}: {os.strerror(code)}; free space on its file system: \d+"
    assert re.fullmatch(message + r" bytes \(.* MiB\)", str(raised.value))
    monkeypatch.undo()
    status = read_status(folder)
    assert status["status"] == "failed" and re.match(rf"RunFileUnwritable: {message}", status["error"]), status
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no torn line left to skip
        kept = [row["round"] for row in read_rounds(folder)]
    assert kept == ([0] if name == ROUNDS_FILE else [0, 1])
    assert not [p.name for p in folder.rglob("*") if p.name.endswith(".tmp")], "no temporary is left"
    assert read_checkpoint(folder).round == 0, "the last whole checkpoint is kept"


def test_a_full_disk_ends_the_serverapp_without_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config("train.rounds=2", "capture.rounds=none", f"out-dir={tmp_path / 'run'}")
    failing_writes(monkeypatch, ROUNDS_FILE, call=2, code=errno.ENOSPC)
    serve(cfg, LocalGrid(make_client_app(cfg), cfg.partition.num_clients))  # returns: an explained stop
    assert read_status(tmp_path / "run")["error"].startswith("RunFileUnwritable: cannot write ")


FILE_SIZE_LIMIT = """
import resource, signal, sys
from flwr.app import Context, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from fedguard.data.registry import load_dataset
from fedguard.runtime.client_app import make_client_app
from fedguard.runtime.server_app import make_server_app
from tests.helpers import config
from tests.local_grid import LocalGrid

TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
cfg = config("train.rounds=2", "capture.rounds=none", "out-dir=" + sys.argv[1])
load_dataset(cfg.data.name, cfg.data.source_options())  # unpacked into the cache before the limit
grid = LocalGrid(make_client_app(cfg), cfg.partition.num_clients)
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
make_server_app(cfg)(grid=grid, context=Context(run_id=1, node_id=0, state=RecordDict(), run_config={}, node_config={}))
"""


def test_a_real_file_size_limit_mid_run_ends_it_failed_naming_the_file(tmp_path: Path) -> None:
    """Under ``RLIMIT_FSIZE`` of 7000 bytes the run's config.toml (5.6 KB) fits and its first checkpoint (8 KB,
    after round 0's evaluation) does not: the system refuses the write with EFBIG."""
    folder = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-c", FILE_SIZE_LIMIT, str(folder), "7000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    status = read_status(folder)
    assert status["status"] == "failed", status
    assert status["error"].startswith(f"RunFileUnwritable: cannot write {folder / CHECKPOINT_FILE}: File too large")
    assert [row["round"] for row in read_rounds(folder)] == [0]
    assert not (folder / CHECKPOINT_FILE).exists() and not list(folder.glob(".*.tmp"))


def hostile_run(out: Path, defense: str, *settings: str, clients: int = 3) -> subprocess.CompletedProcess[str]:
    """``fedguard run`` of ``clients`` clients for 2 rounds whose defense is ``tests.hostile_defense``'s
    ``defense``."""
    command = [str(Path(sys.executable).parent / "fedguard"), "run", "--out", str(out)]
    for setting in (
        "data.name=digits",
        "model.name=mlp",
        "model.mlp.hidden=16",
        f"partition.num-clients={clients}",
        f"train.clients-per-round={clients}",
        "train.rounds=2",
        "capture.rounds=none",
        "server.plugins=tests.hostile_defense",
        f"defense.name={defense}",
        *settings,
    ):
        command += ["--set", setting]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.slow
@pytest.mark.heavy
def test_fedguard_run_exits_non_zero_when_the_global_model_turns_non_finite(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = hostile_run(out, "overflow", clients=2)
    assert result.returncode != 0, (result.stdout + result.stderr)[-3000:]
    assert "Traceback" not in result.stdout + result.stderr, "an explained stop prints no traceback"
    status = read_status(out)
    assert status["status"] == "failed" and "NonFiniteModel: round 1" in status["error"], status
    assert [r["round"] for r in rows(out)] == [0, 1] and "stopped" in rows(out)[-1]


@pytest.mark.slow
def test_a_numeric_extreme_that_passes_the_checks_ends_the_real_run_failed_without_a_traceback(tmp_path: Path) -> None:
    """FedAdam's tau = 1e-308 is a valid setting whose first server step divides by ~0: the run-time case of
    ``tests/test_config_refusals.py``'s extremes."""
    out = tmp_path / "run"
    result = hostile_run(out, "none", "server.strategy=fedadam", "server.fedadam.tau=1e-308")
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in output, output[-3000:]
    assert "the run ended as 'failed': NonFiniteModel: round 1: after aggregation the global model's" in output
    assert read_status(out)["status"] == "failed"


@pytest.mark.slow
def test_a_client_failing_in_a_real_simulation_is_named_with_its_reason(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = hostile_run(out, "broken-client-1")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    for row in rows(out)[1:]:
        assert row["clients"] == 2 and row["failures"] == 1, row
        [failed] = row["failed"]
        assert failed["client"] == 1 and isinstance(failed["node"], int), failed
        assert re.fullmatch(
            rf"ValueError: client 1's defense broke in round {row['round']} \(at .*tests/hostile_defense.py:\d+ in "
            r"defend\)",
            failed["reason"],
        ), failed
    page = html.unescape((out / "report.html").read_text())
    assert "Clients left out of a round" in page and page.count("client 1's defense broke") == 2


@pytest.mark.slow
def test_a_client_process_that_dies_is_replaced_and_its_round_names_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = hostile_run(out, "dying-client-1", "train.rounds=6")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    by_round = {row["round"]: row for row in rows(out)}
    [failed] = by_round[2]["failed"]
    assert failed["client"] == 1 and by_round[2]["clients"] == 2, by_round[2]
    assert failed["reason"].startswith("the client's process died (Actor"), failed
    for round_ in (1, 3, 4, 5, 6):
        assert by_round[round_]["clients"] == 3 and not by_round[round_].get("failures"), by_round[round_]
    page = html.unescape((out / "report.html").read_text())
    assert "Clients left out of a round" in page and failed["reason"] in page


@pytest.mark.slow
def test_a_client_past_the_round_timeout_is_a_straggler_and_the_round_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = hostile_run(out, "slow-client-1", "server.round-timeout=25")  # round 1 starts the clients: ~5 s
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    first, second = rows(out)[1:]
    assert first["stragglers"] == [1] and first["clients"] == 2 and first["seconds"] < SLOW_SECONDS, first
    assert "stragglers" not in second and second["clients"] == 3, second
    assert "straggler" in html.unescape((out / "report.html").read_text())
