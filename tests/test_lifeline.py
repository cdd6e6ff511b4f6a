"""A process tied to its parent (``fedguard.runtime.lifeline``) dies with it, SIGKILL included; the warm runner
dies with its parent while it serves a run and ends cleanly when its input closes between runs; a run folder's
lock is waited for (``fedguard.store.lock.wait_free``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedguard.runtime import lifeline
from fedguard.store.lock import hold, wait_free

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 10.0  # seconds within which a tied child must be gone

CHILD = "import time; from fedguard.runtime import lifeline; print(lifeline.hold(), flush=True); time.sleep(120)"
# A parent that starts CHILD tied to itself, prints the child's process id and sleeps until it is killed.
PARENT = f"""
import os, subprocess, sys, time
from fedguard.runtime import lifeline
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env={{**os.environ, **lifeline.tied()}}, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gone_within(pid: int, limit: float) -> float:
    """Seconds until ``pid`` no longer runs; fails after ``limit``."""
    start = time.monotonic()
    while alive(pid):
        assert time.monotonic() - start < limit, f"process {pid} still runs after {limit:.0f} s"
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_tied_child_dies_with_its_parent_killed_by_sigkill() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert parent.stdout is not None
    child, held = parent.stdout.readline().split()
    assert held == "True" and alive(int(child))
    parent.kill()
    parent.wait()
    print(f"the tied child ended {gone_within(int(child), LIMIT):.2f} s after its parent's SIGKILL")


def test_an_untied_process_holds_no_lifeline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(lifeline.LIFELINE_ENV, raising=False)
    assert not lifeline.is_tied() and lifeline.hold() is False
    assert lifeline.tied()[lifeline.LIFELINE_ENV] == lifeline.STDIN


# The warm runner's request loop with a run that takes a minute in place of a real one.
RUNNER = """
import os, sys, time
import fedguard.runtime.warm_runner as runner
runner.serve_one = lambda request: print("serving", flush=True) or time.sleep(60) or 0
sys.exit(runner.main())
"""


def test_the_warm_runner_dies_with_its_parent_while_it_serves_a_run(tmp_path: Path) -> None:
    runner = subprocess.Popen(
        [sys.executable, "-c", RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert runner.stdin is not None and runner.stdout is not None
    runner.stdin.write(f'{{"preset": "p.toml", "out": "o", "log": "{tmp_path / "log"}"}}\n')
    runner.stdin.flush()
    log, deadline = tmp_path / "log", time.monotonic() + LIMIT
    while not (log.is_file() and "serving" in log.read_text()):
        assert time.monotonic() < deadline, "the request was not served"
        time.sleep(0.05)
    runner.stdin.close()  # what the parent's death does to the pipe
    assert runner.wait(LIMIT) == -signal.SIGKILL


def test_the_warm_runner_ends_cleanly_when_its_input_closes_between_runs() -> None:
    runner = subprocess.Popen([sys.executable, "-c", RUNNER], stdin=subprocess.PIPE, cwd=ROOT)
    assert runner.stdin is not None
    runner.stdin.close()
    assert runner.wait(LIMIT) == 0


def test_a_lock_is_waited_for_until_its_holder_ends(tmp_path: Path) -> None:
    assert wait_free(tmp_path / "no-run", 0.0), "a folder without a lock file"
    folder = tmp_path / "run"
    lock = hold(folder)
    try:
        started = time.monotonic()
        assert not wait_free(folder, 0.3)
        assert time.monotonic() - started >= 0.3
    finally:
        os.close(lock)
    assert wait_free(folder, 0.0)
    os.close(hold(folder))  # the wait kept no lock: this would raise RunFolderBusy
