"""A Flower app fedguard did not write (``examples/flower-app``: its own ClientApp, ServerApp with Flower's FedAvg,
model and data loader) under ``flwr run`` on Flower's local SuperLink, with fedguard's mods and ``Audit``: attacks
scored against the clients' truth, and the detector mod refusing a malicious server's model."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_flwr_run import flower_home  # noqa: F401  (the fixture app_run runs on)

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
APP = ROOT / "examples" / "flower-app"


@pytest.fixture(scope="module")
def app_run(tmp_path_factory: pytest.TempPathFactory, flower_home):  # noqa: F811
    """Runs the example app with ``--run-config`` overrides on Flower's default local SuperLink of a Flower home
    of its own (``tests.test_flwr_run.flower_home``); returns its run folder and its output."""
    home, env = flower_home
    app = tmp_path_factory.mktemp("app") / "flower-app"
    shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__"))

    def run(name: str, overrides: str = "", client_app: str | None = None) -> tuple[Path, str]:
        if client_app is not None:
            (app / "digitsapp" / "client_app.py").write_text(client_app)
        command = [str(BIN / "flwr"), "run", ".", "--stream", "--federation-config", "num-supernodes=4"]
        command += ["--run-config", f"fedguard.out-dir='{name}' {overrides}"]
        result = subprocess.run(command, env=env, cwd=app, capture_output=True, text=True, timeout=300)
        return home / "runs" / name, result.stdout + result.stderr

    return run


def status(folder: Path, output: str) -> dict:
    """The run's ``status.json``; a failure shows the end of ``flwr run``'s output when there is none."""
    assert (folder / "status.json").is_file(), output[-3000:]
    return json.loads((folder / "status.json").read_text())


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_foreign_app_gets_a_report_with_attacks_scored_against_its_clients_truth(app_run) -> None:
    folder, output = app_run("honest")
    assert status(folder, output) == {"status": "completed", "rounds": 3}, output[-3000:]
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
    assert status(folder, output)["status"] == "completed", output[-3000:]
    first, *later = rows(folder / "rounds.jsonl")
    assert first["round"] == 1 and first["clients"] == 0 and first["declined"] == 4
    assert [f["action"] for f in first["detect"]] == ["refuse"] * 4
    assert all(f["structure.flagged"] == 1.0 for f in first["detect"])
    assert [r["clients"] for r in later] == [4, 4]
    assert not list((folder / "observations").glob("*.npz"))


def hooked_client_app() -> str:
    """The example's ClientApp with its train function replaced by the how-to's, which calls ``DefendedTraining``
    (the Python block of docs/how-to/flower-app.md that does)."""
    how_to = (ROOT / "docs" / "how-to" / "flower-app.md").read_text()
    [snippet] = [block for block in re.findall(r"```python\n(.*?)```", how_to, re.S) if "DefendedTraining(msg" in block]
    source = (APP / "digitsapp" / "client_app.py").read_text()
    start, end = source.index("@app.train("), source.index("@app.evaluate()")
    return source[:start] + snippet + "\n\n" + source[end:]


@pytest.mark.slow
def test_the_how_tos_train_function_runs_dp_sgd_at_every_step_in_that_app(app_run) -> None:
    overrides = "fedguard.defense.name='dp-sgd'"  # its defaults: clip 1, noise multiplier 1
    folder, output = app_run("dp-sgd", overrides, client_app=hooked_client_app())
    assert status(folder, output)["status"] == "completed", output[-3000:]
    rounds = rows(folder / "rounds.jsonl")
    epsilons = [r["defense"]["epsilon"] for r in rounds]
    assert epsilons == sorted(epsilons) and epsilons[0] > 0  # spent over the steps of every round so far
    assert [r["defense"]["steps"] for r in rounds] == [4.0, 8.0, 12.0]  # 16 digits in batches of 8, 2 epochs
    attacks = rows(folder / "attacks.jsonl")
    assert {a["status"] for a in attacks} == {"ok"} and len(attacks) == 2
    assert all(a["stats"]["adaptive"] is False for a in attacks)
