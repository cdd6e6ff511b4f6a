"""A real Flower simulation on Ray: clients train, accuracy rises, the server captures uploads."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from fedguard.config import load_config
from fedguard.runtime.server_app import initial_model
from fedguard.store.observation_files import load_observations
from fedguard.training import get_arrays
from tests.commands import quickstart_run

ROOT = Path(__file__).resolve().parents[1]


def run_quickstart(out: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(quickstart_run(out, overrides), capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_simulation_trains_and_captures(tmp_path: Path) -> None:
    out = tmp_path / "run"
    overrides = [
        "train.rounds=12",
        "partition.num-clients=6",
        "train.clients-per-round=6",
        "capture.rounds=1,2",
        "capture.clients=0-2",
        "train.batch-size=32",
        "attack.ig.iterations=60",
        "attack.ig.restarts=1",
    ]
    result = run_quickstart(out, overrides)
    assert "round 12/12" in result.stdout and "left" in result.stdout

    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(13))
    assert all({"round", "accuracy", "loss", "seconds"} <= r.keys() for r in rows)
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.3, rows
    assert rows[-1]["loss"] < rows[0]["loss"]

    observations = load_observations(out / "observations")
    assert observations, "no upload captured"
    assert {o.round for o in observations} <= {1, 2} and {o.client for o in observations} <= {0, 1, 2}
    assert len([o for o in observations if o.round == 1]) == len({o.client for o in observations if o.round == 1})
    config = load_config(out / "config.toml")
    start = get_arrays(initial_model(config))
    for obs in (o for o in observations if o.round == 1):
        assert obs.kind == "gradient" and obs.declared.batch_size == 32
        assert all(np.array_equal(a, b) for a, b in zip(obs.global_arrays, start))
        assert any(np.abs(u).sum() > 0 for u in obs.upload)

    # Every captured upload was attacked, scored against the vault, and shown in the report.
    attacks = [json.loads(line) for line in (out / "attacks.jsonl").read_text().splitlines()]
    assert sorted((a["round"], a["client"]) for a in attacks) == sorted((o.round, o.client) for o in observations)
    assert all(a["status"] == "ok" and a["psnr"] is not None and a["attack"] == "ig" for a in attacks), attacks
    assert len(list((out / "vault").glob("*.npz"))) == len(observations)
    report = (out / "report.html").read_text()
    assert "data:image/png;base64" in report and "ig" in report


@pytest.mark.slow
@pytest.mark.heavy
def test_simulation_survives_attacks_that_run_out_of_time(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_quickstart(
        out,
        [
            "train.rounds=3",
            "partition.num-clients=4",
            "train.clients-per-round=4",
            "capture.clients=0-1",
            "pool.time-limit=0.2",
            "attack.ig.iterations=100000",
        ],
    )
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    attacks = [json.loads(line) for line in (out / "attacks.jsonl").read_text().splitlines()]
    assert len(attacks) == 2 and all(a["status"] == "timeout" and "within" in a["error"] for a in attacks), attacks
    assert "attacks: 0 ok, 2 timeout;" in result.stdout
    assert (out / "report.html").is_file()


@pytest.mark.slow
@pytest.mark.heavy
def test_pruned_uploads_cross_the_wire_encoded_and_arrive_dense(tmp_path: Path) -> None:
    out = tmp_path / "run"
    overrides = [
        "train.rounds=2",
        "partition.num-clients=4",
        "train.clients-per-round=4",
        "capture.rounds=1",
        "capture.clients=0",
        "attack.name=none",
        "defense.name=dgp",
        "train.batch-size=16",
    ]
    run_quickstart(out, overrides)
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    for row in rows[1:]:
        assert row["upload_bytes"] < 0.25 * row["dense_bytes"], row  # DGP sends 20 %: about 0.23 of the bytes
    [obs] = load_observations(out / "observations")
    assert [a.shape for a in obs.upload] == [a.shape for a in obs.global_arrays]  # the server sees it dense
    trainable = [u for u, t in zip(obs.upload, obs.trainable) if t]
    sent = sum(int((u != 0).sum()) for u in trainable) / sum(u.size for u in trainable)
    assert 0.1 < sent <= 0.21, sent


@pytest.mark.slow
@pytest.mark.heavy
def test_the_simulation_runs_on_an_existing_ray_cluster(tmp_path: Path) -> None:
    ray = str(Path(sys.executable).parent / "ray")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="fg-ray-", dir="/tmp")}  # socket paths must be short
    start = [
        ray,
        "start",
        "--head",
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        "--num-cpus=2",
        '--resources={"attacker": 1}',
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    started = subprocess.run(start, capture_output=True, text=True, timeout=120, env=env)
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    try:
        out = tmp_path / "run"
        run_quickstart(
            out,
            [
                "train.rounds=2",
                "partition.num-clients=3",
                "train.clients-per-round=3",
                "capture.rounds=1",
                "capture.clients=0",
                "attack.ig.iterations=5",
                "attack.ig.restarts=1",
                f"sim.address=127.0.0.1:{port}",
            ],
        )
        rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rows] == [0, 1, 2]
        attacks = [json.loads(line) for line in (out / "attacks.jsonl").read_text().splitlines()]
        assert [a["status"] for a in attacks] == ["ok"]
    finally:
        stop_processes_mentioning(env["RAY_TMPDIR"])  # this cluster's processes only, never the machine's others
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)


def stop_processes_mentioning(text: str) -> None:
    """SIGTERM, then SIGKILL, every process whose command line contains ``text`` (a cluster's temp folder)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        found = subprocess.run(["pgrep", "-f", text], capture_output=True, text=True)
        pids = [int(p) for p in found.stdout.split() if int(p) != os.getpid()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if not pids:
            return
        time.sleep(2)


LISTENING_PROBE = """
import os, ray
ray.init(num_cpus=1, include_dashboard=False)
ours = {str(os.getpid())} | {p for p in os.listdir('/proc') if p.isdigit() and os.environ['RAY_TMPDIR'].encode()
                              in open(f'/proc/{p}/cmdline', 'rb').read()}
inodes = set()
for pid in ours:
    for fd in os.listdir(f'/proc/{pid}/fd'):
        try:
            inodes.add(os.readlink(f'/proc/{pid}/fd/{fd}'))
        except OSError:
            pass
for table in ('/proc/net/tcp', '/proc/net/tcp6'):
    for row in open(table).read().splitlines()[1:]:
        fields = row.split()
        if fields[3] == '0A' and f'socket:[{fields[9]}]' in inodes:  # 0A: LISTEN
            print('LISTEN', fields[1].split(':')[0])
ray.shutdown()
"""

LOOPBACK_HEX = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1 as IPv4 and IPv4-mapped IPv6


@pytest.mark.slow
def test_the_simulations_own_ray_cluster_listens_on_loopback_only(tmp_path: Path) -> None:
    from fedguard.runtime.simulation import _environment

    config = load_config(ROOT / "experiments" / "quickstart.toml")
    env = _environment(tmp_path, config)
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="fg-ray-", dir="/tmp")
    env.pop("RAY_ADDRESS", None)
    try:
        result = subprocess.run(
            [sys.executable, "-c", LISTENING_PROBE], env=env, capture_output=True, text=True, timeout=180
        )
        addresses = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("LISTEN")]
        assert len(addresses) >= 3, result.stdout[-2000:] + result.stderr[-2000:]  # GCS, raylet, workers
        assert set(addresses) <= LOOPBACK_HEX, addresses
    finally:
        stop_processes_mentioning(env["RAY_TMPDIR"])
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)


def test_joining_a_cluster_leaves_rays_addresses_to_the_cluster(tmp_path: Path, monkeypatch) -> None:
    from fedguard.runtime.simulation import LOOPBACK_RAY, _environment

    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # as an activated venv sets it
    config = load_config(ROOT / "experiments" / "quickstart.toml", ["sim.address=10.0.0.5:6379"])
    env = _environment(tmp_path, config)
    assert env["RAY_ADDRESS"] == "10.0.0.5:6379"
    assert not set(LOOPBACK_RAY) & set(env)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    alone = _environment(tmp_path, load_config(ROOT / "experiments" / "quickstart.toml"))
    assert alone["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0" and "RAY_ADDRESS" not in alone


@pytest.mark.parametrize("address", ["127.0.0.1:6379", "localhost:6379", "[::1]:6379", "auto"])
def test_joining_a_cluster_on_this_machine_keeps_the_loopback_switch(tmp_path: Path, monkeypatch, address: str) -> None:
    """Without the switch Ray would take 127.0.0.1 for the machine's network address, where a head started
    with it does not listen; with it, a head started either way is reached (tests/test_ray_cluster.py)."""
    from fedguard.runtime.simulation import LOOPBACK_RAY, _environment

    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    env = _environment(tmp_path, load_config(ROOT / "experiments" / "quickstart.toml", [f"sim.address={address}"]))
    assert env["RAY_ADDRESS"] == address
    assert {name: env.get(name) for name in LOOPBACK_RAY} == LOOPBACK_RAY


COUNTING_PLUGIN = '''
"""An attack that logs each build with its process id, and a log of every validation after this import."""
import os
from dataclasses import dataclass

import fedguard.config
from attackers.base import class_traits, register_attack
from attackers.dlg import DLGParams, DeepLeakage


def _log(what):
    with open(os.environ["FEDGUARD_COUNT_LOG"], "a") as log:
        log.write(f"{what} {os.getpid()}\\n")


@dataclass(frozen=True)
class CountedParams(DLGParams):
    """iDLG that logs its builds"""


@register_attack("counted-idlg", params=CountedParams, traits=class_traits(DeepLeakage))
def build_counted(params):
    _log("build")
    return DeepLeakage(params, infer=True)


_validate = fedguard.config._build


def _counted_build(flat):
    _log("validate")
    return _validate(flat)


fedguard.config._build = _counted_build
'''


@pytest.mark.slow
def test_one_run_builds_each_attack_once_per_worker_and_validates_once_per_process(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "counting_plugin.py").write_text(COUNTING_PLUGIN)
    count_log = tmp_path / "counts.log"
    monkeypatch.setenv("FEDGUARD_COUNT_LOG", str(count_log))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    run_quickstart(
        out,
        [
            "server.plugins=counting_plugin",
            "attack.name=counted-idlg",
            "pool.workers=2",
            "attack.counted-idlg.iterations=3",
            "train.rounds=2",
            "partition.num-clients=4",
            "train.clients-per-round=4",
            "capture.rounds=1,2",
            "capture.clients=0-3",
        ],
    )
    attacks = [json.loads(line) for line in (out / "attacks.jsonl").read_text().splitlines()]
    assert len(attacks) == 8 and {a["status"] for a in attacks} == {"ok"}
    events = [line.split() for line in count_log.read_text().splitlines()]
    builds = [pid for what, pid in events if what == "build"]
    validations = [pid for what, pid in events if what == "validate"]
    assert 1 <= len(builds) <= 2 and len(set(builds)) == len(builds), events  # one per worker, two workers
    assert len(validations) == 1, events  # the CLI validates; the ServerApp and the ClientApps rebuild its plan


# The Python API in a process of its own (the counting plugin patches the validation of the process it is in).
API_RUN = """
import sys
import fedguard
fedguard.run(sys.argv[1], out=sys.argv[2], overrides=sys.argv[3:], progress=None)
"""


@pytest.mark.slow
def test_a_run_started_from_python_validates_once_across_its_processes(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "counting_plugin.py").write_text(COUNTING_PLUGIN)
    count_log = tmp_path / "counts.log"
    monkeypatch.setenv("FEDGUARD_COUNT_LOG", str(count_log))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(ROOT)]))
    overrides = ["server.plugins=counting_plugin", "attack.name=counted-idlg", "attack.counted-idlg.iterations=3"]
    overrides += ["train.rounds=1", "partition.num-clients=2", "train.clients-per-round=2", "capture.clients=0-1"]
    started = subprocess.run(
        [sys.executable, "-c", API_RUN, str(ROOT / "experiments" / "quickstart.toml"), str(tmp_path / "run")]
        + overrides,
        capture_output=True,
        text=True,
        timeout=400,
        cwd=tmp_path,
    )
    assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
    events = [line.split() for line in count_log.read_text().splitlines()]
    assert [what for what, _ in events].count("validate") == 1, events  # fedguard.run's; the rest rebuild its plan
    assert "build" in [what for what, _ in events], "the attack ran"
