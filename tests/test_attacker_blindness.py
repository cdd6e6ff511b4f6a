"""The attacker never holds the ground truth: nothing of the vault reaches an attack.

What an attack is given (the ``Observation`` objects the server hands its sinks, the files in
``observations/``, the arguments the worker is built and called with) holds no array of a vault batch and
no vault path, and attack code opens no vault file. Checked in process, on a run whose clients write the
vault, and on a real ``fedguard run``, whose every Python process carries an audit hook
(``tests/open_log_hook.py``) that notes which code opens vault files and which processes are attack
workers. Each check is shown to catch a truth put where the attacker can see it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attackers.base import build_attack
from attackers.sinks import FanOut
from fedguard.config import Config
from fedguard.observation import Observation
from fedguard.runtime import client_app
from fedguard.runtime.client_app import make_client_app
from fedguard.runtime.server_app import run_server
from fedguard.store.folder import OBSERVATIONS_DIR, UPLOAD_GLOB, VAULT_DIR, upload_file_name
from fedguard.store.observation_files import load_observations
from fedguard.store.vault import read_truth
from tests import open_log_hook
from tests.helpers import config
from tests.local_grid import LocalGrid

Truths = dict[str, np.ndarray]  # "<vault file>:images" / ":labels" -> the array


# --- the checks -------------------------------------------------------------------------------------


def vault_truths(vault: Path) -> Truths:
    """Every true batch in ``vault``, images and labels apart."""
    truths: Truths = {}
    for path in sorted(vault.glob(UPLOAD_GLOB)):
        round_, client = (int(part.split("-")[1]) for part in path.stem.split("_"))
        images, labels = read_truth(vault, round_, client)
        truths[f"{path.name}:images"], truths[f"{path.name}:labels"] = images.numpy(), labels.numpy()
    return truths


def observation_arrays(obs: Observation) -> Iterator[tuple[str, np.ndarray]]:
    """Every array an observation holds, named by field: global and uploaded arrays, declared numbers."""
    yield from ((f"global_arrays[{i}]", np.asarray(a)) for i, a in enumerate(obs.global_arrays))
    yield from ((f"upload[{i}]", np.asarray(a)) for i, a in enumerate(obs.upload))
    for key, value in obs.declared.record().items():
        array = np.asarray(value)
        if array.dtype.kind in "biuf":
            yield f"declared[{key!r}]", array


def holds(field: np.ndarray, truth: np.ndarray) -> bool:
    """Whether ``field`` holds ``truth``: its values in any shape and numeric type, or (images) its bytes
    anywhere inside."""
    if field.size == truth.size and np.array_equal(field.astype(np.float64).ravel(), truth.astype(np.float64).ravel()):
        return True
    return truth.dtype.kind == "f" and truth.tobytes() in np.ascontiguousarray(field).tobytes()


def leaks(obs: Observation, truths: Truths, vault: Path) -> list[str]:
    """What of the vault ``obs`` holds: '<field> holds <truth>', or the vault's path in its metadata."""
    found = [
        f"{name} holds {key}"
        for name, array in observation_arrays(obs)
        for key, truth in truths.items()
        if holds(array, truth)
    ]
    if str(vault) in json.dumps(obs.meta()):
        found.append("its metadata names the vault")
    return found


@contextmanager
def watched(vault: Path) -> Iterator[list[dict[str, Any]]]:
    """What ``open_log_hook.Watch`` notes inside the block: files opened under ``vault``, and whether this
    process unpickled attack work."""
    seen: list[dict[str, Any]] = []
    watch = open_log_hook.Watch(vault, seen.append)
    sys.addaudithook(watch)
    try:
        yield seen
    finally:
        watch.note = lambda record: None  # an audit hook stays installed for the life of the process


def legitimate(record: dict[str, Any]) -> bool:
    """A vault file opened by the vault's own functions for a client writing its batch, for the evaluator
    scoring (called back from the attack runner's thread in the server), or for the run report setting each
    true image beside its reconstruction; no attack code on the stack."""
    stack = record["stack"]
    if writes(record):  # a write goes through the replace-on-success writer, the store's, called by the vault
        vault_frames = ["fedguard/atomic.py", "fedguard/store/folder.py", "fedguard/store/vault.py"]
        users: tuple[str, ...] = ("clients/defended_client.py",)
    else:
        vault_frames, users = ["fedguard/store/vault.py"], ("fedguard/evaluation.py", "fedguard/report/html.py")
    scheduling = ("attackers/runner.py", "attackers/pool.py")  # the thread that hands the outcome to the evaluator
    attack_code = [f for f in stack if f.startswith("attackers/") and f not in scheduling]
    return stack[: len(vault_frames)] == vault_frames and any(u in stack for u in users) and not attack_code


def writes(record: dict[str, Any]) -> bool:
    """Whether an ``open`` record's mode creates or changes the file (``w``, ``x``, ``a`` or ``+``)."""
    return any(flag in record["mode"] for flag in "wxa+")


def attack_factory_args(cfg: Config) -> tuple[Any, ...]:
    """The arguments of the factory the attacker pool sends each worker (``build_attack``), for the run's
    one attack."""
    attack = cfg.attacks[0]
    return attack.name, attack.params, (cfg.defense.name, cfg.defense.params)


# --- in process ---------------------------------------------------------------------------------------

IN_PROCESS = ("train.rounds=2", "capture.rounds=1", "capture.clients=all", "attack.name=none")
ATTACK = ("attack.name=idlg", "attack.idlg.iterations=3", "attack.idlg.device=cpu")


@pytest.fixture
def captured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[Observation]]:
    """A run of 4 in-process clients (3 a round) that write the vault as in a simulation: its folder, and every
    ``Observation`` the server handed its sinks (the disk and, when attacks run, the attacker pool)."""
    monkeypatch.setattr(client_app, "in_simulation", lambda: True)
    handed: list[Observation] = []
    submit = FanOut.submit

    def recording(self: FanOut, obs: Observation) -> None:
        handed.append(obs)
        submit(self, obs)

    monkeypatch.setattr(FanOut, "submit", recording)
    cfg = config(*IN_PROCESS, f"out-dir={tmp_path / 'run'}")
    folder = run_server(LocalGrid(make_client_app(cfg), cfg.partition.num_clients), cfg)
    return folder, handed


def test_what_attacks_are_given_holds_nothing_of_the_vault(captured: tuple[Path, list[Observation]]) -> None:
    folder, handed = captured
    vault = folder / VAULT_DIR
    truths = vault_truths(vault)
    assert len(truths) == 2 * len(handed) == 6, "every captured upload has its truth in the vault"
    saved = load_observations(folder / OBSERVATIONS_DIR)
    assert [(o.round, o.client) for o in saved] == sorted((o.round, o.client) for o in handed)
    for obs in [*handed, *saved]:
        assert leaks(obs, truths, vault) == [], (obs.round, obs.client)
    assert str(vault) not in repr(attack_factory_args(config(*ATTACK)))


def test_attack_code_opens_no_vault_file(captured: tuple[Path, list[Observation]]) -> None:
    folder, handed = captured
    with watched(folder / VAULT_DIR) as opened:
        attack = build_attack(*attack_factory_args(config(*ATTACK)))
        reconstructions = attack.reconstruct_many(handed, 0)
    assert len(reconstructions) == len(handed)
    assert opened == []


def test_a_truth_put_in_an_observation_is_caught(captured: tuple[Path, list[Observation]]) -> None:
    folder, handed = captured
    vault = folder / VAULT_DIR
    obs = handed[0]
    images, labels = (a.numpy() for a in read_truth(vault, obs.round, obs.client))
    padded = np.concatenate([obs.global_arrays[0].ravel(), images.ravel()])
    planted = {
        "images as float64 rows": dataclasses.replace(
            obs, upload=[images.astype(np.float64).reshape(len(images), -1), *obs.upload[1:]]
        ),
        "image bytes inside an array": dataclasses.replace(obs, global_arrays=[padded, *obs.global_arrays[1:]]),
        "labels declared": dataclasses.replace(
            obs, declared=obs.declared.with_fields(extra={"batch": labels.tolist()})
        ),
        "the vault's path": dataclasses.replace(obs, declared=obs.declared.with_fields(extra={"from": str(vault)})),
    }
    for how, leaky in planted.items():
        assert leaks(leaky, vault_truths(vault), vault), how


class VaultReader:
    """An attack that cheats: it reads the truth of each upload it is given."""

    def __init__(self, vault: Path) -> None:
        self.vault = vault

    def reconstruct_many(self, observations: list[Observation], seed: int) -> list[Any]:
        return [read_truth(self.vault, obs.round, obs.client) for obs in observations]


def test_attack_code_that_reads_the_vault_is_caught(captured: tuple[Path, list[Observation]]) -> None:
    folder, handed = captured
    with watched(folder / VAULT_DIR) as opened:
        VaultReader(folder / VAULT_DIR).reconstruct_many(handed, 0)
    assert sorted(Path(r["path"]).name for r in opened) == sorted(
        upload_file_name(obs.round, obs.client) for obs in handed
    )
    assert not any(legitimate(r) for r in opened)


def test_a_process_handed_attack_work_is_marked_an_attack_worker(captured: tuple[Path, list[Observation]]) -> None:
    folder, handed = captured
    with watched(folder / VAULT_DIR) as records:
        pickle.loads(pickle.dumps(handed[0]))  # as a worker receives its uploads
    assert records == [{"pid": os.getpid(), "worker": True}]


# --- a real run -------------------------------------------------------------------------------------

REAL_RUN = [
    "data.name=digits",
    "model.name=mlp",
    "model.mlp.hidden=16",
    "partition.num-clients=2",
    "train.clients-per-round=2",
    "train.rounds=2",
    "train.batch-size=8",
    "capture.rounds=1",
    "capture.clients=all",
    "attack.name=idlg",
    "attack.idlg.iterations=20",
    "attack.idlg.device=cpu",
    "pool.wait=120",
]


def watched_run(tmp_path: Path) -> tuple[Path, list[dict[str, Any]]]:
    """``fedguard run`` of ``REAL_RUN`` with the audit hook in every Python process it starts: its folder and
    the hook's records."""
    out, hooks, log = tmp_path / "run", tmp_path / "hooks", tmp_path / "opens.jsonl"
    hooks.mkdir()
    shutil.copy(open_log_hook.__file__, hooks / "sitecustomize.py")
    env = {
        **os.environ,
        open_log_hook.WATCH_DIR_ENV: str(out / VAULT_DIR),
        open_log_hook.WATCH_LOG_ENV: str(log),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "fedguard", "run", "--out", str(out)]
    for override in REAL_RUN:
        command += ["--set", override]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.slow
def test_a_real_run_keeps_the_truth_from_the_attack_workers(tmp_path: Path) -> None:
    out, records = watched_run(tmp_path)
    attacks = [json.loads(line) for line in (out / "attacks.jsonl").read_text().splitlines()]
    assert len(attacks) == 2 and all(a["status"] == "ok" and a["psnr"] is not None for a in attacks), attacks

    workers = {r["pid"] for r in records if r.get("worker")}
    opened = [r for r in records if "path" in r]
    assert workers, "the hook saw no attack worker"
    assert {r["pid"] for r in opened}.isdisjoint(workers), [r for r in opened if r["pid"] in workers]
    assert any(writes(r) for r in opened) and any(not writes(r) for r in opened), opened
    assert all(legitimate(r) for r in opened), [r for r in opened if not legitimate(r)]

    vault = out / VAULT_DIR
    truths = vault_truths(vault)
    for obs in load_observations(out / OBSERVATIONS_DIR):
        assert leaks(obs, truths, vault) == [], (obs.round, obs.client)
