"""Captured uploads on disk are untrusted files: ``fedguard attack`` checks each against the run before
allocating or decompressing anything it declares, skips a bad one with its name and reason, and attacks the
others; ``fedguard train-mjolnir --at`` refuses a bad one."""

from __future__ import annotations

import io
import json
import shutil
import time
import tracemalloc
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.lib import format as npy

from fedguard.commands.cli import main
from fedguard.config import load_config
from fedguard.limits import MAX_META_BYTES
from fedguard.store.folder import ATTACKS_FILE, OBSERVATIONS_DIR, REPORT_FILE, read_jsonl, upload_file_name
from fedguard.store.observations import ObservationRefused, RunExpectations, read_observation
from tests.commands import QUICK_IG, settings
from tests.test_evaluation import make_run

IG = settings(QUICK_IG)
BOMB_BYTES = 256 * 2**20  # what the deflated meta of the zip bomb declares (about 0.25 MB on disk)


def rewrite(source: Path, target: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """``source`` written to ``target`` with its meta changed by ``edit``, its arrays as they were."""
    with np.load(source) as archive:
        arrays = {key: archive[key] for key in archive.files}
    meta = json.loads(str(arrays.pop("meta")))
    edit(meta)
    with open(target, "wb") as out:
        np.savez(out, meta=np.array(json.dumps(meta)), **arrays)
    return target


def moved_to(client: int) -> Callable[[dict[str, Any]], None]:
    def edit(meta: dict[str, Any]) -> None:
        meta["client"] = client

    return edit


def npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    out = io.BytesIO()
    npy.write_array_header_1_0(out, {"descr": descr, "fortran_order": False, "shape": shape})
    return out.getvalue()


def with_member(source: Path, target: Path, name: str, write: Callable[[io.BufferedIOBase], None]) -> Path:
    """``source`` written to ``target`` with member ``name`` (deflated) replaced by what ``write`` writes."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w") as new:
        for info in old.infolist():
            if info.filename != name:
                new.writestr(info.filename, old.read(info))
        with new.open(zipfile.ZipInfo(name), "w", force_zip64=True) as member:
            write(member)
    return target


def huge_header(member: io.BufferedIOBase) -> None:
    """A .npy header claiming 10^6 x 10^6 float32 (3.64 TiB), and 16 bytes."""
    member.write(npy_header("<f4", (10**6, 10**6)) + bytes(16))


def zip_bomb(member: io.BufferedIOBase) -> None:
    """A consistent 0-d string of ``BOMB_BYTES``: zeros, which deflate a thousandfold."""
    header = npy_header(f"<U{BOMB_BYTES // 4}", ())
    member.write(header)
    chunk = bytes(2**20)
    for _ in range(BOMB_BYTES // len(chunk)):
        member.write(chunk)


@pytest.fixture
def hostile_run(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A run with three good uploads (clients 0-2) and five bad ones, each with the reason it is skipped."""
    folder = make_run(tmp_path, batch=1, clients=3)
    observations = folder / OBSERVATIONS_DIR
    good = observations / upload_file_name(1, 0)
    scratch = tmp_path / "scratch"
    scratch.mkdir()

    def moved(client: int) -> Path:
        return rewrite(good, scratch / f"{client}.npz", moved_to(client))

    bad = {
        upload_file_name(1, 3): with_member(
            moved(3), observations / upload_file_name(1, 3), "upload/0.npy", huge_header
        ),
        upload_file_name(1, 4): with_member(moved(4), observations / upload_file_name(1, 4), "meta.npy", zip_bomb),
        upload_file_name(1, 5): rewrite(
            good, observations / upload_file_name(1, 5), lambda meta: meta.update(client=5, declared=[1, 2])
        ),
    }
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(good, outside / upload_file_name(1, 0))
    (observations / upload_file_name(1, 6)).symlink_to(outside / upload_file_name(1, 0))
    shutil.copy(good, observations / "round-1_client-0.npz")  # a second file of client 0's upload
    reasons = {
        upload_file_name(1, 3): "member 'upload/0.npy' has shape (1000000, 1000000), expected (32, 3072)",
        upload_file_name(1, 4): f"its meta declares {BOMB_BYTES + 128} bytes, more than the {MAX_META_BYTES} a "
        "meta may hold",
        upload_file_name(1, 5): "meta declared = [1, 2]: expected a JSON object",
        upload_file_name(1, 6): "a symbolic link; observations are read only from files in the run folder",
        "round-1_client-0.npz": "its meta declares round 1, client 0, whose file is round-0001_client-0000.npz",
    }
    assert set(bad) < set(reasons)
    return folder, reasons


def test_attack_skips_each_bad_observation_with_its_reason_and_attacks_the_good_ones(
    hostile_run: tuple[Path, dict[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    folder, reasons = hostile_run
    start = time.monotonic()
    assert main(["attack", str(folder), *IG]) == 0
    took = time.monotonic() - start
    out = capsys.readouterr().out
    for name, reason in reasons.items():
        assert f"fedguard: skipped {folder / OBSERVATIONS_DIR / name}: {reason}\n" in out, out
    assert "ig on 3 of 3 observations" in out and "5 observations of 8 skipped" in out
    rows = read_jsonl(folder / ATTACKS_FILE)
    assert sorted((row["round"], row["client"], row["status"]) for row in rows) == [(1, c, "ok") for c in range(3)]
    assert (folder / REPORT_FILE).is_file()
    assert took < 60, f"{took:.0f} s"


def test_reading_a_bad_observation_allocates_nothing_it_declares(hostile_run: tuple[Path, dict[str, str]]) -> None:
    folder, reasons = hostile_run
    expected = RunExpectations.of(load_config(folder / "config.toml"))
    for name in (upload_file_name(1, 3), upload_file_name(1, 4)):
        tracemalloc.start()
        try:
            with pytest.raises(ObservationRefused, match=reasons[name].replace("(", r"\(").replace(")", r"\)")):
                read_observation(folder / OBSERVATIONS_DIR / name, folder, expected)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2**20, f"{name}: {peak} bytes at the peak"


def test_a_deflated_observation_is_read_like_a_stored_one(hostile_run: tuple[Path, dict[str, str]]) -> None:
    folder, _ = hostile_run
    expected = RunExpectations.of(load_config(folder / "config.toml"))
    good = folder / OBSERVATIONS_DIR / upload_file_name(1, 2)
    plain = read_observation(good, folder, expected)
    with np.load(good) as archive:
        arrays = {key: archive[key] for key in archive.files}
    good.unlink()
    np.savez_compressed(good, **arrays)
    packed = read_observation(good, folder, expected)
    assert all(np.array_equal(a, b) for a, b in zip(plain.upload, packed.upload)) and packed.meta() == plain.meta()


def edited(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A meta edit setting ``path`` ('declared/batch-size') to ``value``."""
    *parents, leaf = path.split("/")

    def edit(meta: dict[str, Any]) -> None:
        node = meta
        for key in parents:
            node = node[key]
        node[leaf] = value

    return edit


@pytest.mark.parametrize(
    "path, value, reason",
    [
        ("round", "1", "meta round = '1': expected an integer in [1, 20] (train.rounds)"),
        ("round", 21, "meta round = 21: expected an integer in [1, 20] (train.rounds)"),
        ("client", 10, "meta client = 10: expected an integer in [0, 9] (partition.num-clients)"),
        ("client", True, "meta client = True: expected an integer in [0, 9]"),
        ("num_examples", 10**9, "meta num_examples = 1000000000: expected an integer in [1, "),
        ("declared/batch-size", "lots", "declares batch-size = 'lots', expected an integer in [1, 1]"),
        ("declared/batch-size", 10**7, "declares batch-size = 10000000, expected an integer in [1, 1]"),
        ("declared/labels", [0, 1], "declares labels [0, 1], expected a list of 1 classes"),
        ("declared/lr", "fast", "declares lr = 'fast', expected 0.5 (the run's train.lr)"),
        ("declared/loss", [1], "declared loss = [1]: expected a number"),
        (
            "model_params/hidden",
            10**6,
            "meta model_params = {'batch_norm': False, 'depth': 2, 'hidden': 1000000}: "
            "expected {'batch_norm': False, 'depth': 2, 'hidden': 32}, the run's",
        ),
        ("model_params/depth", 2.0, "meta model_params = "),
        ("kind", "weights", "meta kind = 'weights': expected 'gradient', the upload of train.protocol = 'fedsgd'"),
        ("names", ["a"], "meta names = ['a']: expected "),
        ("spec", [3, 10**5, 10**5, 10], "meta spec = [3, 100000, 100000, 10]: expected [3, 32, 32, 10], the run's"),
        ("manipulation", 7, "meta manipulation = 7: expected one of none, "),
    ],
)
def test_each_meta_field_is_checked_against_the_run(tmp_path: Path, path: str, value: Any, reason: str) -> None:
    folder = make_run(tmp_path, batch=1, clients=1)
    target = folder / OBSERVATIONS_DIR / upload_file_name(1, 0)
    rewrite(target, target, edited(path, value))
    with pytest.raises(ObservationRefused) as refused:
        read_observation(target, folder, RunExpectations.of(load_config(folder / "config.toml")))
    assert f"{target}: {reason}" in str(refused.value)


def test_train_mjolnir_refuses_a_bad_capture_at(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = make_run(tmp_path, batch=1, clients=1)
    target = folder / OBSERVATIONS_DIR / upload_file_name(1, 0)
    rewrite(target, target, edited("round", "1"))
    preset = ["--set", "data.name=photos", "--set", "model.mlp.hidden=32"]
    assert main(["train-mjolnir", *preset, "--at", str(target), "--out", str(tmp_path / "d.npz")]) == 2
    assert f"--at {target}: meta round = '1': expected an integer in [1, 20]" in capsys.readouterr().err


def test_attack_exits_2_when_every_observation_is_refused(
    hostile_run: tuple[Path, dict[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    folder, _ = hostile_run
    for client in range(3):
        (folder / OBSERVATIONS_DIR / upload_file_name(1, client)).unlink()
    assert main(["attack", str(folder), *IG]) == 2
    captured = capsys.readouterr()
    assert "ig on 0 of 0 observations" in captured.out and "5 observations of 5 skipped" in captured.out
    assert f"fedguard: no observation of {folder} was attacked" in captured.err
