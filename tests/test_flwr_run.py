"""`flwr run` on a SuperLink started by hand (simulation runtime, no runtime installs), as docs/how-to/flwr-run.md
shows."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fedguard.runtime.launcher import free_port, superlink_command, write_flower_home

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def wait_for_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"SuperLink did not listen on {port} within {timeout} s")


@contextmanager
def local_superlink(tmp_path: Path, cwd: Path, env: dict[str, str]) -> Iterator[dict[str, str]]:
    """A simulation SuperLink on a free loopback port, started in ``cwd``, with a Flower home in ``tmp_path`` whose
    default federation is it; yields ``env`` with that home, telemetry off and the venv's tools first on PATH."""
    port = free_port()
    home = tmp_path / "flwr-home"
    home.mkdir()
    write_flower_home(home, port, "fedguard")
    env = {**env, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "PATH": f"{BIN}:{os.environ['PATH']}"}
    superlink = subprocess.Popen(
        superlink_command(port, tmp_path / "state.db", str(BIN / "flower-superlink")),
        env=env,
        cwd=cwd,
        stdout=open(tmp_path / "superlink.log", "w"),  # noqa: SIM115 - the SuperLink writes it as long as it runs
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for_port(port, 60)
        yield env
    finally:
        os.killpg(superlink.pid, signal.SIGTERM)
        try:
            superlink.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(superlink.pid, signal.SIGKILL)


@pytest.mark.slow
def test_flwr_run_with_a_local_superlink(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with local_superlink(tmp_path, tmp_path, dict(os.environ)) as env:
        overrides = f"partition.num-clients=4 train.clients-per-round=4 train.rounds=3 out-dir='{out}'"
        result = subprocess.run(
            [
                str(BIN / "flwr"),
                "run",
                str(ROOT),
                "fedguard",
                "--federation-config",
                "num-supernodes=4",
                "--run-config",
                overrides,
                "--stream",
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        rows_file = out / "rounds.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not rows_file.exists() or len(rows_file.read_text().splitlines()) < 4):
            time.sleep(1)
        rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
        assert [r["round"] for r in rows] == [0, 1, 2, 3]
        assert rows[-1]["accuracy"] > rows[0]["accuracy"]
        assert (out / "config.toml").is_file() and list((out / "observations").glob("*.npz"))


def stop_local_superlink(port: int) -> None:
    """Stop the local SuperLink ``flwr run`` started on ``port`` (and its process group), none other."""
    found = subprocess.run(["pgrep", "-f", f"flower-superlink.*--port {port}"], capture_output=True, text=True)
    for pid in map(int, found.stdout.split()):
        try:
            os.killpg(os.getpgid(pid), signal.SIGTERM)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def flower_home(tmp_path_factory: pytest.TempPathFactory):
    """A Flower home of its own and the environment of an activated venv (``make install`` adds
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 to it): ``flwr run .`` starts Flower's default local
    SuperLink on ports of its own, stopped at the end."""
    home = tmp_path_factory.mktemp("flwr-home")
    http_port, control_port = free_port(), free_port()
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FEDGUARD_RUNS": str(home / "runs"),
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http_port),
        "FLWR_LOCAL_CONTROL_API_PORT": str(control_port),
        "PATH": f"{BIN}:{os.environ['PATH']}",
    }
    yield home, env
    stop_local_superlink(http_port)


@pytest.mark.slow
@pytest.mark.heavy
def test_flwr_run_on_flowers_default_federation_stops_and_says_how_to_fix_it(flower_home) -> None:
    home, env = flower_home
    start = time.monotonic()
    result = subprocess.run(
        [str(BIN / "flwr"), "run", ".", "--stream", "--run-config", "train.rounds=2"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    output = result.stdout + result.stderr
    assert "2 SuperNodes are connected after 10 s, but partition.num-clients = 10" in output, output[-3000:]
    assert "--federation-config 'num-supernodes=10'" in output
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert "Installing application dependencies" not in output
    [folder] = (home / "runs").iterdir()
    assert json.loads((folder / "status.json").read_text())["status"] == "failed"


@pytest.mark.slow
@pytest.mark.heavy
def test_flwr_run_selects_a_user_strategy_from_outside_the_package(flower_home) -> None:
    home, env = flower_home
    overrides = (
        "data.name='digits' partition.num-clients=4 train.clients-per-round=4 train.rounds=2 "
        "capture.rounds='none' out-dir='user-strategy' server.plugins='extensions.norm_clipped' "
        "server.strategy='norm-clipped-fedavg' "
        "server.plugin-params='server.norm-clipped-fedavg.clip=0.001'"
    )
    result = subprocess.run(
        [
            str(BIN / "flwr"),
            "run",
            ".",
            "--stream",
            "--federation-config",
            "num-supernodes=4",
            "--run-config",
            overrides,
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert "norm-clipped-fedavg: round 2: 4 of 4 uploads clipped to 0.001" in output, output[-3000:]
    folder = home / "runs" / "user-strategy"
    assert json.loads((folder / "status.json").read_text())["status"] == "completed"
    assert [json.loads(line)["round"] for line in (folder / "rounds.jsonl").read_text().splitlines()] == [0, 1, 2]


@pytest.mark.slow
@pytest.mark.heavy
def test_fedguard_run_selects_a_user_strategy_through_flwr_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = subprocess.run(
        [
            str(BIN / "fedguard"),
            "run",
            "--set",
            "data.name=digits",
            "--set",
            "partition.num-clients=3",
            "--set",
            "train.clients-per-round=3",
            "--set",
            "train.rounds=2",
            "--set",
            "capture.rounds=none",
            "--set",
            "server.plugins=extensions.norm_clipped",
            "--set",
            "server.strategy=norm-clipped-fedavg",
            "--set",
            "server.norm-clipped-fedavg.clip=0.002",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "norm-clipped-fedavg: round 1: 3 of 3 uploads clipped to 0.002" in output
    assert json.loads((out / "status.json").read_text()) == {"status": "completed", "rounds": 2}


@pytest.mark.slow
def test_flwr_run_with_an_unknown_key_is_refused_and_the_superlink_log_names_it(flower_home) -> None:
    home, env = flower_home
    result = subprocess.run(
        [str(BIN / "flwr"), "run", ".", "--run-config", "train.roundz=2"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "Invalid run configuration" in result.stdout + result.stderr
    assert "train.roundz" in (home / "local-superlink" / "superlink.log").read_text()


IMPORT_MARKER = """
import os as _os
with open({log!r}, "a") as _log:
    _log.write(f"{tag} import {{_os.getpid()}} {{__file__}}\\n")
"""
ATTACK_MARKER = """
_unmarked_build_attack = build_attack


def build_attack(*args, **kwargs):
    import os as _os
    with open({log!r}, "a") as _log:
        _log.write(f"{tag} attack {{_os.getpid()}} {{__file__}}\\n")
    return _unmarked_build_attack(*args, **kwargs)
"""


def marked_copy(folder: Path, tag: str, log: Path) -> Path:
    """A copy of this checkout's files (git's tracked and untracked, none ignored) whose ``fedguard`` and
    ``attackers`` packages write ``tag`` and the process id to ``log`` when imported, and whose ``build_attack``
    does so when called (only attacker workers build attacks)."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes((ROOT / name).read_bytes())
    for package in ("fedguard", "attackers"):
        with open(folder / package / "__init__.py", "a") as init:
            init.write(IMPORT_MARKER.format(log=str(log), tag=tag))
    with open(folder / "attackers" / "base.py", "a") as base:
        base.write(ATTACK_MARKER.format(log=str(log), tag=tag))
    return folder


@pytest.mark.slow
@pytest.mark.heavy
def test_flwr_run_runs_the_submitted_apps_code_in_every_process(tmp_path: Path) -> None:
    """A SuperLink started in one copy of the app runs a second copy: the ServerApp, the ClientApps and the
    attacker workers all import the submitted copy, none the SuperLink's working directory."""
    log = tmp_path / "imports.log"
    stale, app = marked_copy(tmp_path / "stale", "stale", log), marked_copy(tmp_path / "app", "app", log)
    out = tmp_path / "run"
    with local_superlink(tmp_path, stale, {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}) as env:
        overrides = (
            f"data.name='digits' partition.num-clients=2 train.clients-per-round=2 train.rounds=1 "
            f"attack.name='dlg' attack.dlg.iterations=2 out-dir='{out}'"
        )
        result = subprocess.run(
            [
                str(BIN / "flwr"),
                "run",
                ".",
                "fedguard",
                "--federation-config",
                "num-supernodes=2",
                "--run-config",
                overrides,
                "--stream",
            ],
            env=env,
            cwd=app,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        status = out / "status.json"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not status.exists():
            time.sleep(1)
        assert json.loads(status.read_text())["status"] == "completed"
    home = Path(env["FLWR_HOME"])
    lines = [line.split(" ", 3) for line in log.read_text().splitlines()]
    assert not [line for line in lines if line[0] == "stale"], log.read_text()
    installed = str(home / "apps")  # where the SuperLink unpacked the submitted app
    attacks = [(pid, file) for tag, what, pid, file in lines if what == "attack"]
    assert attacks and all(file.startswith(installed) for _, file in attacks), log.read_text()
    importers = {pid for tag, what, pid, file in lines if what == "import" and file.startswith(installed)}
    assert {pid for pid, _ in attacks} <= importers, log.read_text()
    assert len(importers) >= 3, log.read_text()  # the ServerApp, an attacker and at least one ClientApp
    rows = [json.loads(line) for line in (out / "attacks.jsonl").read_text().splitlines()]
    assert rows and {r["status"] for r in rows} == {"ok"}, rows
