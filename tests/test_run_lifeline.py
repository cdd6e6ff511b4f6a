"""Whatever ends ``fedguard run`` ends its run: a SIGKILL leaves no process of the run within seconds, nor its
temporary Flower home, and ``status.json`` saying ``interrupted``; a killed ``fedguard sweep`` takes its run
with it, and resumes it when started again; a run folder held by a live run refuses a second writer, naming the
holder's process id, and one whose holder died blocks nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fedguard.commands.cli import main
from fedguard.report.run_status import read_status
from fedguard.runtime.processes import Process, running_programs, signal_all
from fedguard.store.lock import RunFolderBusy, hold
from tests.commands import ENDLESS_RUN, QUICKSTART, quickstart_run
from tests.test_clean_stop import TAG, kill_all, tagged, wait_for_rounds

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 10.0  # seconds within which a killed run must be gone and recorded

# A launcher whose run is two sleepers (one in a session of its own, as the SuperLink is), killed while it waits.
FAKE_LAUNCHER = """
import os, subprocess, sys, tempfile, time
import fedguard.runtime.launcher as launcher

def run(plan, env):
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    subprocess.Popen(sleeper, env=env, start_new_session=True)
    subprocess.Popen(sleeper, env=env)
    print("running", plan.home, flush=True)
    time.sleep(120)

launcher._run = run
launcher.launch(launcher.Launch(app_dir="", out_dir=sys.argv[1], home=tempfile.mkdtemp(), env=dict(os.environ),
                                federation=""))
"""


def gone_within(tag: str, folder: Path, limit: float) -> float:
    """Seconds until no process carries ``tag`` and ``folder``'s status.json exists; fails after ``limit``."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        if not tagged(tag) and read_status(folder) is not None:
            return time.monotonic() - start
        time.sleep(0.1)
    left = {pid: describe(pid) for pid in tagged(tag)}
    raise AssertionError(f"after {limit:.0f} s: processes {left} left, status {read_status(folder)}")


def describe(pid: int) -> str:
    """``pid``'s state and command line, read from /proc (empty when it is gone)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        command = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
    return f"{state} {command[:200]}"


def test_a_killed_launcher_leaves_no_process_and_an_interrupted_run(tmp_path: Path) -> None:
    folder, tag = tmp_path / "run", uuid.uuid4().hex
    folder.mkdir()
    (folder / "rounds.jsonl").write_text("".join(json.dumps({"round": r}) + "\n" for r in range(4)))
    fake = subprocess.Popen(
        [sys.executable, "-c", FAKE_LAUNCHER, str(folder)],
        env={**os.environ, TAG: tag},
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert fake.stdout is not None
        running, home = fake.stdout.readline().split()
        assert running == "running" and Path(home).is_dir()
        started = time.monotonic()
        while len(tagged(tag)) < 4 and time.monotonic() - started < LIMIT:  # the watcher may start after
            time.sleep(0.05)
        assert len(tagged(tag)) == 4, "the launcher, its watcher and the two sleepers"
        with pytest.raises(RunFolderBusy, match=f"is being written by fedguard run \\(process {fake.pid}\\)"):
            os.close(hold(folder))
        fake.kill()
        took = gone_within(tag, folder, LIMIT)
    finally:
        kill_all(tag)
    print(f"every process gone and the run recorded {took:.1f} s after SIGKILL")
    status = read_status(folder)
    assert status == {
        "status": "interrupted",
        "rounds": 3,
        "error": f"fedguard run (process {fake.pid}) ended without stopping the run",
    }
    os.close(hold(folder))  # the dead holder left nothing that blocks
    assert not Path(home).exists(), "the watcher removed the run's temporary Flower home"


def test_a_second_writer_is_refused_until_the_holder_dies(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from fedguard.store.lock import hold; "
            "hold(sys.argv[1]); print('held', flush=True); time.sleep(120)",
            str(folder),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(
            RunFolderBusy, match=f"process {holder.pid}\\); wait for it to end, or stop it \\(kill -INT {holder.pid}\\)"
        ):
            hold(folder)
    finally:
        holder.kill()
        holder.wait()
    os.close(hold(folder))


@pytest.mark.slow
def test_sigkill_of_fedguard_run_ends_its_run_and_a_live_run_refuses_a_second_writer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, tag = tmp_path / "run", uuid.uuid4().hex
    command = quickstart_run(out, ENDLESS_RUN)
    with open(tmp_path / "output.log", "w") as output:
        process = subprocess.Popen(
            command, env={**os.environ, TAG: tag}, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for_rounds(out, 2, process)
        resume = subprocess.run(
            [sys.executable, "-m", "fedguard", "run", "--resume", str(out)], capture_output=True, text=True, timeout=120
        )
        assert resume.returncode == 2, resume.stderr[-3000:]
        assert f"is being written by fedguard run (process {process.pid})" in resume.stderr
        assert main(["run", QUICKSTART, "--out", str(out)]) == 2, "a new run into the folder"
        assert "already holds a run" in capsys.readouterr().err
        assert read_status(out) is None, "still running"
        process.send_signal(signal.SIGKILL)
        try:
            took = gone_within(tag, out, LIMIT)
        finally:
            log = (tmp_path / "output.log").read_text()
            print(log[-3000:])
    finally:
        kill_all(tag)
    print(f"every process of the run gone and status.json written {took:.1f} s after SIGKILL")
    status = read_status(out)
    assert status is not None and status["status"] == "interrupted" and status["rounds"] >= 2, status
    assert f"fedguard run (process {process.pid}) ended without stopping its run" in log, log[-3000:]
    os.close(hold(out))


@pytest.mark.slow
@pytest.mark.heavy
def test_a_terminated_sweep_stops_its_run_cleanly(tmp_path: Path) -> None:
    preset = tmp_path / "sweep.toml"
    preset.write_text(
        'name = "stopped"\n[data]\nname = "digits"\n[partition]\nnum-clients = 3\n[train]\n'
        'rounds = 500\nclients-per-round = 3\n[capture]\nrounds = "none"\n'
        '[sweep.variants.none]\n"defense.name" = "none"\n'
    )
    tag = uuid.uuid4().hex
    with open(tmp_path / "output.log", "w") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "fedguard", "sweep", str(preset), "--out", str(tmp_path / "sweep")],
            env={**os.environ, TAG: tag},
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    out = tmp_path / "sweep" / "run" / "none"
    try:
        wait_for_rounds(out, 2, process)
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 130
        left = tagged(tag)
    finally:
        kill_all(tag)
    assert left == [], "the sweep's run stopped with it"
    status = read_status(out)
    assert status is not None and status["status"] == "interrupted", status


def test_the_supervisor_finds_a_process_of_the_run_that_lost_the_token_from_its_environment() -> None:
    """A child whose environment no longer holds the run's token (as Ray's agents, which rename themselves over
    it) is found below its marked parent, and stopped with it."""
    from fedguard.runtime.processes import is_running
    from fedguard.runtime.supervisor import RUN_TOKEN_ENV, run_processes, stop_run

    token = uuid.uuid4().hex
    child = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], env={}); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", child], env={**os.environ, RUN_TOKEN_ENV: token})
    try:
        deadline = time.monotonic() + 20
        found: set[Process] = set()
        while time.monotonic() < deadline and len(found) < 2:
            found = run_processes(token)
            time.sleep(0.1)
        assert {p.pid for p in found} > {parent.pid} and len(found) == 2, found
        assert stop_run(token) == 2
        assert not any(is_running(p) for p in found)
    finally:
        parent.kill()


def left_after(before: set[Process], limit: float) -> tuple[float, dict[int, str]]:
    """Seconds until no Python process started since ``before`` is left, and those left after ``limit``."""
    start = time.monotonic()
    while True:
        left = running_programs() - before
        if not left or time.monotonic() - start >= limit:
            return time.monotonic() - start, {p.pid: describe(p.pid) for p in left}
        time.sleep(0.1)


STOPPED_SWEEP = (
    'name = "killed"\n[data]\nname = "digits"\n[partition]\nnum-clients = 3\n[train]\n'
    'rounds = 6\nclients-per-round = 3\n[capture]\nrounds = "none"\n'
    '[sweep.variants.none]\n"defense.name" = "none"\n'
    '[sweep.variants.prune]\n"defense.name" = "prune"\n'
)


@pytest.mark.slow
@pytest.mark.parametrize("cold", [False, pytest.param(True, marks=pytest.mark.heavy)], ids=["warm", "cold"])
def test_a_killed_sweep_takes_its_run_with_it_and_resumes_it_when_started_again(tmp_path: Path, cold: bool) -> None:
    preset = tmp_path / "sweep.toml"
    preset.write_text(STOPPED_SWEEP)
    command = [sys.executable, "-m", "fedguard", "sweep", str(preset), "--out", str(tmp_path / "sweep")]
    out = tmp_path / "sweep" / "run" / "none"
    before = running_programs()
    with open(tmp_path / "output.log", "w") as output:
        process = subprocess.Popen(
            command + (["--cold"] if cold else []), stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for_rounds(out, 2, process)
        process.send_signal(signal.SIGKILL)
        killed_at = time.time()
        took, left = left_after(before, LIMIT)
    finally:
        signal_all(running_programs() - before, signal.SIGKILL)
    print(f"every process of the sweep gone {took:.1f} s after SIGKILL")
    assert left == {}, left
    status = read_status(out)
    assert status is not None and status["status"] == "interrupted", status
    assert (out / "rounds.jsonl").stat().st_mtime <= killed_at + 1.0, "no round written once the sweep was dead"
    stopped_after = status["rounds"]

    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"stopped after round {stopped_after} of 6; resuming it" in again.stdout, again.stdout[-3000:]
    assert "finished earlier" not in again.stdout, "no run it did not see finish is kept"
    rows = [json.loads(line) for line in (tmp_path / "sweep" / "runs.jsonl").read_text().splitlines()]
    assert [(row["variant"], row.get("status")) for row in rows] == [("none", "ok"), ("prune", "ok")], rows
    rounds = [json.loads(line)["round"] for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert rounds == list(range(7)), rounds
    assert read_status(out) == {"status": "completed", "rounds": 6}
