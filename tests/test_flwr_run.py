"""`flwr run` on a SuperLink started by hand (simulation runtime, no runtime installs): the README's way."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"SuperLink did not listen on {port} within {timeout} s")


@pytest.mark.slow
def test_flwr_run_with_a_local_superlink(tmp_path: Path) -> None:
    port = free_port()
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "fedguard"\n\n[superlink.fedguard]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "PATH": f"{BIN}:{os.environ['PATH']}"}
    superlink = subprocess.Popen(
        [str(BIN / "flower-superlink"), "--insecure", "--simulation", "--disable-runtime-dependency-installation",
         "--host", "127.0.0.1", "--port", str(port), "--database", str(tmp_path / "state.db")],
        env=env, cwd=tmp_path, stdout=open(tmp_path / "superlink.log", "w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    out = tmp_path / "run"
    try:
        wait_for_port(port, 60)
        overrides = f"partition.num-clients=4 train.clients-per-round=4 train.rounds=3 out-dir='{out}'"
        result = subprocess.run(
            [str(BIN / "flwr"), "run", str(ROOT), "fedguard", "--federation-config", "num-supernodes=4",
             "--run-config", overrides, "--stream"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
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
    finally:
        os.killpg(superlink.pid, signal.SIGTERM)
        try:
            superlink.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(superlink.pid, signal.SIGKILL)
