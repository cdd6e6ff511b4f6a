"""One SIGINT or SIGTERM stops ``fedguard run`` within seconds: the attacks still running are recorded as
interrupted, the report is written, status.json says so, nothing the run started is left running, and the exit
code is 128 + the signal's number. ``sim.*`` a simulation would wait on forever are refused at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from fedguard.commands.cli import main
from fedguard.runtime.launcher import free_port
from fedguard.runtime.processes import ProcessTracker, is_running
from fedguard.runtime.stopping import RunInterrupted, StoppableGrid, StopRequest
from fedguard.store.folder import write_atomic
from tests.commands import ENDLESS_RUN, QUICKSTART, quickstart_run

TAG = "FEDGUARD_TEST_RUN_TAG"  # every process of a run inherits the environment, so this marks them all


def tagged(tag: str) -> list[int]:
    """The processes whose environment holds ``TAG=tag`` (a zombie's environment reads empty: not counted)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if f"{TAG}={tag}".encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def kill_all(tag: str) -> None:
    for pid in tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def wait_for_rounds(out: Path, rounds: int, process: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    log = out / "rounds.jsonl"
    while time.monotonic() < deadline and process.poll() is None:
        if log.is_file() and len(log.read_text().splitlines()) > rounds:
            return
        time.sleep(0.2)
    raise AssertionError(f"round {rounds} not reached (exit code {process.poll()})")


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, to_group",
    [pytest.param(signal.SIGINT, True, marks=pytest.mark.heavy), (signal.SIGTERM, False)],
    ids=["sigint-to-the-terminal-group", "sigterm-to-the-process"],
)
def test_one_signal_stops_the_run_with_every_result_kept(tmp_path: Path, signum: int, to_group: bool) -> None:
    out, tag = tmp_path / "run", uuid.uuid4().hex
    command = quickstart_run(out, [*ENDLESS_RUN, "attack.ig.restarts=1"])
    with open(tmp_path / "output.log", "w") as output:
        process = subprocess.Popen(
            command, env={**os.environ, TAG: tag}, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )  # a terminal's foreground group of its own
    try:
        wait_for_rounds(out, 4, process)
        sent = time.monotonic()
        if to_group:  # Ctrl-C: the terminal signals its foreground process group
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)
        code = process.wait(60)
        took = time.monotonic() - sent
        left = tagged(tag)
    finally:
        kill_all(tag)
    log = (tmp_path / "output.log").read_text()
    print(f"stopped {took:.1f} s after {signal.Signals(signum).name}")

    assert code == 128 + signum, log[-3000:]
    assert took < 30, f"the run took {took:.1f} s to stop"
    assert left == [], f"processes of the run left running: {left}"
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "interrupted" and signal.Signals(signum).name in status["error"], status
    captured = sorted(p.name for p in (out / "observations").glob("*.npz"))
    rows = [json.loads(line) for line in (out / "attacks.jsonl").read_text().splitlines()]
    assert sorted(f"round-{r['round']:04d}_client-{r['client']:04d}.npz" for r in rows) == captured, rows
    assert {r["status"] for r in rows} == {"interrupted"}, rows
    assert "Run status: interrupted" in (out / "report.html").read_text()
    assert f"attacks: 0 ok, {len(rows)} interrupted" in log
    assert "Traceback" not in log, log[-3000:]


def refusal(tmp_path: Path, capsys: pytest.CaptureFixture[str], *overrides: str) -> str:
    """What ``fedguard run`` says when it refuses ``overrides``: exit code 2 within 30 s, nothing started."""
    args = ["run", QUICKSTART, "--out", str(tmp_path / "run")]
    for override in overrides:
        args += ["--set", override]
    start = time.monotonic()
    code = main(args)
    assert code == 2 and time.monotonic() - start < 30
    assert not (tmp_path / "run").exists()
    return capsys.readouterr().err


def test_clients_reserving_more_cpus_than_the_cluster_has_are_refused(tmp_path: Path, capsys) -> None:
    err = refusal(tmp_path, capsys, "sim.client-cpus=64")
    assert (
        f"sim.client-cpus = 64: each client would reserve more CPU cores than the simulation's Ray cluster "
        f"has (sim.num-cpus = 2; this machine has {os.cpu_count()}); set it to at most 2" in err
    )


def test_clients_reserving_a_gpu_where_none_is_visible_are_refused(tmp_path: Path, capsys) -> None:
    import torch

    if torch.cuda.device_count():
        pytest.skip("a GPU is visible here")
    err = refusal(tmp_path, capsys, "sim.client-gpus=1")
    assert (
        "sim.client-gpus = 1: each client would reserve more GPUs than are visible (0); set it to at most 0 "
        "(0: clients train on CPUs)" in err
    )


def test_a_cluster_address_where_nothing_answers_is_refused(tmp_path: Path, capsys, monkeypatch) -> None:
    port = free_port()
    err = refusal(tmp_path, capsys, f"sim.address=127.0.0.1:{port}")
    assert f"sim.address = '127.0.0.1:{port}': no Ray cluster answers at 127.0.0.1:{port}" in err
    assert "leave sim.address empty" in err
    assert "not a Ray cluster address; write host:port, ray://host:port or auto" in refusal(
        tmp_path, capsys, "sim.address=head-node"
    )
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    assert f"RAY_ADDRESS (environment) = '127.0.0.1:{port}': no Ray cluster answers" in refusal(tmp_path, capsys)


class SilentGrid:
    """A grid whose clients never reply."""

    def push_messages(self, messages):
        return [str(index) for index, _ in enumerate(messages)]

    def pull_messages(self, message_ids):
        return []


def test_a_stop_request_ends_a_round_that_waits_for_replies(tmp_path: Path) -> None:
    stop_file = tmp_path / "stop-request"
    grid = StoppableGrid(SilentGrid(), StopRequest(stop_file))  # type: ignore[arg-type]
    threading.Timer(0.3, lambda: write_atomic(stop_file, "SIGINT")).start()  # as the launcher writes it
    start = time.monotonic()
    with pytest.raises(RunInterrupted, match="stopped by SIGINT"):
        grid.send_and_receive(["message"] * 3, timeout=3600)
    assert time.monotonic() - start < 2


def test_processes_that_lost_their_parent_are_still_stopped() -> None:
    orphan_maker = (
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; "
        "time.sleep(120)']); time.sleep(1.5)"
    )
    parent = subprocess.Popen([sys.executable, "-c", orphan_maker])
    tracker = ProcessTracker()
    tracker.watch(parent.pid)
    deadline = time.monotonic() + 10
    while len(tracker.seen) < 2 and time.monotonic() < deadline:
        tracker.update()
        time.sleep(0.05)
    parent.wait(10)  # the child lives on, its parent gone
    [orphan] = [p for p in tracker.seen if p.pid != parent.pid]
    assert is_running(orphan)
    assert tracker.stop(patience=0.2) == set() and not is_running(orphan)
