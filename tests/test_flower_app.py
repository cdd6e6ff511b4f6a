"""A Flower app fedguard did not write (``examples/flower-app``: its own ClientApp, ServerApp with Flower's FedAvg,
model and data loader) under ``flwr run`` on Flower's local SuperLink, with fedguard's mods and ``Audit``: attacks
scored against the clients' truth, and the detector mod refusing a malicious server's model."""

from __future__ import annotations

import html
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_flwr_run import free_port, stop_local_superlink

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
APP = ROOT / "examples" / "flower-app"


@pytest.fixture(scope="module")
def app_run(tmp_path_factory: pytest.TempPathFactory):
    """Runs the example app with ``--run-config`` overrides; returns its run folder and its output."""
    home = tmp_path_factory.mktemp("flwr-home")
    app = tmp_path_factory.mktemp("app") / "flower-app"
    shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__"))
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

    def run(name: str, overrides: str = "") -> tuple[Path, str]:
        command = [str(BIN / "flwr"), "run", ".", "--stream", "--federation-config", "num-supernodes=4"]
        command += ["--run-config", f"fedguard.out-dir='{name}' {overrides}"]
        result = subprocess.run(command, env=env, cwd=app, capture_output=True, text=True, timeout=300)
        return home / "runs" / name, result.stdout + result.stderr

    yield run
    stop_local_superlink(http_port)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_foreign_app_gets_a_report_with_attacks_scored_against_its_clients_truth(app_run) -> None:
    folder, output = app_run("honest")
    assert json.loads((folder / "status.json").read_text()) == {"status": "completed", "rounds": 3}, output[-3000:]
    rounds = rows(folder / "rounds.jsonl")
    assert [r["round"] for r in rounds] == [1, 2, 3] and all(r["clients"] == 4 for r in rounds)
    assert all(0 <= r["accuracy"] <= 1 for r in rounds)
    assert all(f["flagged"] == 0.0 for r in rounds for f in r["detect"])
    attacks = rows(folder / "attacks.jsonl")
    assert sorted((a["round"], a["client"], a["status"]) for a in attacks) == [(1, 0, "ok"), (1, 1, "ok")]
    assert all(a["defense"] == "dgp" and a["model"] == "digitsapp-net" and a["psnr"] > 0 for a in attacks)
    assert sorted(p.name for p in (folder / "vault").iterdir()) == [
        "round-0001_client-0000.npz",
        "round-0001_client-0001.npz",
    ]
    assert json.loads((folder / "app.json").read_text())["nodes"] == 4
    report = html.unescape((folder / "report.html").read_text())
    assert "digitsapp-net" in report and "the app's own" in report and "ig-adaptive" in report


@pytest.mark.slow
def test_the_detector_mod_refuses_the_imprint_servers_model_in_that_app(app_run) -> None:
    folder, output = app_run("malicious", "fedguard.threat.malicious='1:imprint' fedguard.attack.name='imprint'")
    assert json.loads((folder / "status.json").read_text())["status"] == "completed", output[-3000:]
    first, *later = rows(folder / "rounds.jsonl")
    assert first["round"] == 1 and first["clients"] == 0 and first["declined"] == 4
    assert [f["action"] for f in first["detect"]] == ["refuse"] * 4
    assert all(f["structure.flagged"] == 1.0 for f in first["detect"])
    assert [r["clients"] for r in later] == [4, 4]
    assert not list((folder / "observations").glob("*.npz"))
