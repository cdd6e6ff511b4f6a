"""Experiment tracking: the rows a run writes reach TensorBoard (read back with TensorBoard's own reader) and
MLflow (a file store, and a real ``mlflow server`` on loopback), images included; a tracker that fails is
dropped with a warning and the run goes on."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fedguard.config import load_config
from fedguard.runtime.launcher import free_port
from fedguard.store.folder import read_jsonl
from fedguard.tracking import Trackers, open_trackers, tracker_problems
from tests.test_api import fake_run


def replay(folder: Path, overrides: list[str]) -> None:
    """Open the trackers ``overrides`` turn on and give them ``folder``'s rows, as a run does."""
    trackers = open_trackers(load_config(None, ["name=tracked", *overrides]), folder)
    for row in read_jsonl(folder / "rounds.jsonl"):
        trackers.round(row)
    for row in read_jsonl(folder / "attacks.jsonl"):
        trackers.attack(row)
    trackers.finish("completed")


def test_tensorboard_receives_the_rounds_the_scores_the_images_and_the_configuration(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fake_run(tmp_path)
    replay(tmp_path, ["track.tensorboard=true"])
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0, "scalars": 0}).Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("round/accuracy")] == [(0, 0.1), (1, 0.4)]
    assert [e.value for e in events.Scalars("defense/raw")] == [0.5]
    assert [(e.step, e.value) for e in events.Scalars("attack/ig/psnr")] == [(1, 30.0)]
    assert "attack/idlg/psnr" not in events.Tags()["scalars"], "an attack that failed has no score"
    [image] = events.Images("images/ig/round-0001_client-0001")
    assert (image.step, image.width, image.height) == (1, 3 * 64 + 2, 2 * 64 + 1), "3 truths above 3 recons"
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '    [train]\n    protocol = "fedsgd"\n    rounds = 20\n' in config


def test_tensorboard_holds_an_hparams_session_of_the_used_keys_and_the_last_metrics(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    fake_run(tmp_path)
    replay(tmp_path, ["track.tensorboard=true", "defense.name=dp"])
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    tagged = events.PluginTagToContent("hparams").items()  # KeyError: no HParams session
    contents = {tag: plugin_data_pb2.HParamsPluginData.FromString(content) for tag, content in tagged}
    experiment = next(c.experiment for c in contents.values() if c.HasField("experiment"))
    hparams = {h.name for h in experiment.hparam_infos}
    assert {"train.rounds", "defense.dp.noise-multiplier", "status"} <= hparams
    assert not any(name.startswith("defense.dgp.") for name in hparams)
    metrics = {m.name.tag for m in experiment.metric_infos}
    assert {"round/accuracy", "defense/raw", "attack/ig/ssim"} <= metrics
    start = next(c.session_start_info for c in contents.values() if c.HasField("session_start_info"))
    assert start.hparams["train.rounds"].number_value == 20
    assert start.hparams["status"].string_value == "completed"
    assert [round(e.value, 6) for e in events.Scalars("round/accuracy")][-1] == 0.4, "the metric's last value"


def check_mlflow_run(uri: str, experiment: str, name: str) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.run_name == name and run.info.status == "FINISHED", "named after the run folder"
    assert run.data.params["train.rounds"] == "20" and run.data.tags["fedguard.defense"] == "none"
    assert "defense.dp.clip" not in run.data.params and "attack.ig.iterations" not in run.data.params
    history = client.get_metric_history(run.info.run_id, "round/accuracy")
    assert [(m.step, round(m.value, 6)) for m in history] == [(0, 0.1), (1, 0.4)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "attack/ig/ssim")] == [0.9]
    assert client.get_metric_history(run.info.run_id, "defense/raw")[0].value == 0.5
    images = sorted(a.path for a in client.list_artifacts(run.info.run_id, "images"))
    assert images == ["images/round-0001_client-0001_ig_recon.png", "images/round-0001_client-0001_ig_truth.png"]


def test_mlflow_logs_to_a_local_store_in_the_run_folder_by_default(tmp_path: Path) -> None:
    fake_run(tmp_path)
    replay(tmp_path, ["track.mlflow=true", "track.mlflow-experiment=tests"])
    check_mlflow_run(f"sqlite:///{tmp_path / 'mlflow.db'}", "tests", tmp_path.name)
    assert list((tmp_path / "mlflow-artifacts").rglob("round-0001_client-0001_ig_truth.png"))


def test_only_the_keys_the_run_uses_are_logged() -> None:
    """Before, every registered component's parameters were logged: 294 keys for a run with defense dp."""
    config = load_config(None, ["defense.name=dp", "attack.name=ig"])
    used = config.used_flat()
    assert len(config.to_flat()) > 250 and len(used) < 80
    assert {"train.rounds", "defense.name", "defense.dp.clip", "attack.ig.iterations", "pool.workers"} <= set(used)
    assert not [key for key in used if key.startswith(("defense.dgp.", "attack.dlg.", "server.fedadam."))]
    assert "pool.workers" not in load_config(None, ["defense.name=dp"]).used_flat(), "no attack: no pool"


def test_a_sweep_logs_its_runs_nested_under_one_parent_run_in_the_sweep_folder(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from fedguard.tracking.mlflow_sweep import sweep_parent

    configs = [load_config(None, ["track.mlflow=true", f"seed={seed}"]) for seed in (0, 1)]
    folders = [tmp_path / "privacy" / "dp" / f"seed-{seed}" for seed in (0, 1)]
    with sweep_parent("demo", tmp_path, configs) as nest:
        for config, folder in zip(configs, folders, strict=True):
            fake_run(folder)
            trackers = open_trackers(nest(config), folder)
            trackers.finish("completed")
    assert not (folders[0] / "mlflow.db").exists(), "one store for the sweep"
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("fedguard").experiment_id])
    [parent] = [run for run in runs if run.info.run_name == "demo"]
    assert parent.info.status == "FINISHED"
    nested = {run.info.run_name: run.data.tags.get("mlflow.parentRunId") for run in runs if run is not parent}
    assert nested == {"privacy/dp/seed-0": parent.info.run_id, "privacy/dp/seed-1": parent.info.run_id}


def test_a_tracked_run_prints_no_warning(tmp_path: Path) -> None:
    """Before, MLflow's SQL store printed SQLAlchemy's deprecation of ``noload`` in every run's output."""
    fake_run(tmp_path)
    script = (  # every warning the tracking stack raises shown, as a run that sets no filters shows SQLAlchemy's
        "import sys, warnings; from pathlib import Path; from tests.test_tracking import replay; "
        "warnings.filterwarnings('default', module='(mlflow|sqlalchemy|tensorboard|torch)'); "
        "replay(Path(sys.argv[1]), ['track.mlflow=true', 'track.tensorboard=true'])"
    )
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "mlflow.db").exists() and (tmp_path / "tensorboard").is_dir()
    assert "Warning" not in done.stdout + done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_mlflow_logs_to_a_tracking_server(tmp_path: Path) -> None:
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'mlflow.db'}",
            "--artifacts-destination",
            str(tmp_path / "artifacts"),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "server.log", "w"),  # noqa: SIM115 - the server writes it as long as it runs
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError((tmp_path / "server.log").read_text()[-3000:]) from None
                time.sleep(0.5)
        fake_run(tmp_path / "run")
        replay(tmp_path / "run", ["track.mlflow=true", f"track.mlflow-uri={uri}", "track.mlflow-experiment=served"])
        assert not (tmp_path / "run" / "mlflow.db").exists()
        check_mlflow_run(uri, "served", "run")
        assert list((tmp_path / "artifacts").rglob("round-0001_client-0001_ig_recon.png")), "stored by the server"
    finally:
        server.terminate()
        server.wait(30)


class Failing:
    name = "failing"

    def __init__(self) -> None:
        self.calls = 0

    def start(self, config: object) -> None:
        self.calls += 1

    def round(self, row: dict) -> None:
        self.calls += 1
        raise OSError("disk full")

    def attack(self, row: dict, truth: object, recon: object) -> None:
        self.calls += 1

    def finish(self, status: str) -> None:
        self.calls += 1


def test_a_failing_tracker_is_named_and_dropped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    failing = Failing()
    trackers = Trackers([failing], tmp_path)
    with caplog.at_level(logging.WARNING):
        trackers.round({"round": 1, "accuracy": 0.5})
        trackers.round({"round": 2, "accuracy": 0.6})
        trackers.finish("completed")
    assert failing.calls == 1 and trackers.trackers == []
    assert "tracking: failing failed in round (OSError: disk full); the run goes on without it" in caplog.text
    with caplog.at_level(logging.WARNING):
        unreachable = open_trackers(
            load_config(None, ["track.mlflow=true", "track.mlflow-uri=ftp://nowhere"]), tmp_path
        )
    assert unreachable.trackers == [] and "tracking: mlflow could not be opened" in caplog.text


def test_a_tracker_whose_package_is_missing_is_refused_before_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    config = load_config(None, ["track.mlflow=true", "track.tensorboard=true"])
    assert tracker_problems(config) == [
        "track.mlflow = true needs the mlflow package, which is not installed: pip install mlflow"
    ]
    assert tracker_problems(load_config(None)) == []


def test_an_mlflow_server_that_does_not_answer_is_refused_before_the_run() -> None:
    """Before, the run started and MLflow retried the dead address for minutes per call."""
    uri = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    [problem] = tracker_problems(load_config(None, ["track.mlflow=true", f"track.mlflow-uri={uri}"]))
    assert time.monotonic() - start < 5
    assert problem.startswith(f"track.mlflow-uri = {uri!r}: no MLflow server answers there (")
    assert "Connection refused" in problem
    assert tracker_problems(load_config(None, ["track.mlflow=true"])) == []  # a store in the run folder


def test_a_server_that_answers_at_the_mlflow_uri_passes_the_check() -> None:
    """Whatever it answers (a proxy may refuse /health without credentials): only silence is refused."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        config = load_config(None, ["track.mlflow=true", f"track.mlflow-uri=http://127.0.0.1:{port}"])
        assert tracker_problems(config) == []  # http.server answers 404 for /health
    finally:
        server.terminate()
        server.wait(timeout=10)
