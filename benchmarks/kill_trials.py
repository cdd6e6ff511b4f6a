"""SIGKILL trials: ``fedguard run`` and ``fedguard sweep`` killed in the middle of a run, every other trial with
every core busy (one spinning process per core, started by this script).

A run trial runs the quickstart with 3 clients for 500 rounds and IG attacking rounds 1-2, and kills
``fedguard run`` (the process alone, SIGKILL) once 2 rounds are logged. A sweep trial runs a sweep of two cells
(none, prune; 6 rounds each), kills ``fedguard sweep`` the same way in its first cell, then starts the same
sweep again and lets it finish. Per trial it prints: whether the cores were busy, the seconds until no Python
process the trial started was left (``fedguard.runtime.processes.running_programs``), how long the killed
process took to die (the kernel ends a process some milliseconds after SIGKILL, longer on busy cores; until then
its children see it alive), the rows written in that time and after it died (rounds and attack rows whose ``at``
is later), the killed run's ``status.json``; for a sweep, whether
the sweep started again completed every cell from a run it saw (it resumed the killed one, kept nothing as
"finished earlier", and every row is ``ok``). Then the worst of each.

    .venv/bin/python benchmarks/kill_trials.py [--runs 10] [--sweeps 5] [--out runs/bench-kill-trials]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedguard.report.run_status import read_status
from fedguard.runtime.processes import Process, running_programs, signal_all
from fedguard.store.rows import read_attacks, read_rounds

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 60.0  # seconds a trial waits for the killed run's processes to end before it counts them as left
RUN = [
    "--set",
    "train.rounds=500",
    "--set",
    "partition.num-clients=3",
    "--set",
    "train.clients-per-round=3",
    "--set",
    "capture.rounds=1-2",
    "--set",
    "capture.clients=0-2",
    "--set",
    "attack.ig.iterations=1000000",
]
SWEEP = (
    'name = "killed"\n[data]\nname = "digits"\n[partition]\nnum-clients = 3\n[train]\n'
    'rounds = 6\nclients-per-round = 3\n[capture]\nrounds = "none"\n'
    '[sweep.variants.none]\n"defense.name" = "none"\n[sweep.variants.prune]\n"defense.name" = "prune"\n'
)


@contextmanager
def busy_cores(busy: bool) -> Iterator[None]:
    """Every core kept busy by a spinning process while the block runs, when ``busy``."""
    count = (os.cpu_count() or 1) if busy else 0
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def wait_for_rounds(folder: Path, rounds: int, process: subprocess.Popen[bytes], timeout: float = 600.0) -> None:
    """Wait until ``folder``'s rounds log holds round ``rounds``."""
    deadline = time.monotonic() + timeout
    log = folder / "rounds.jsonl"
    while time.monotonic() < deadline and process.poll() is None:
        if log.is_file() and len(log.read_text().splitlines()) > rounds:
            return
        time.sleep(0.2)
    raise RuntimeError(f"round {rounds} not reached in {folder} (exit code {process.poll()})")


def killed(command: list[str], folder: Path, log: Path, before: set[Process]) -> dict[str, Any]:
    """Start ``command``, SIGKILL it once ``folder`` logged 2 rounds; what was left and written after."""
    with open(log, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    wait_for_rounds(folder, 2, process)
    process.send_signal(signal.SIGKILL)
    signalled_at, start = time.time(), time.monotonic()
    process.wait()  # the kernel has ended it: from now on its processes see it dead
    dead_at = time.time()
    while (left := running_programs() - before) and time.monotonic() - start < LIMIT:
        time.sleep(0.1)
    gone = time.monotonic() - start
    signal_all(left, signal.SIGKILL)
    time.sleep(2.0)  # a late writer would show now
    stamps = [row.get("at", 0) for row in [*read_rounds(folder), *read_attacks(folder)]]
    status = read_status(folder) or {}
    return {
        "gone_s": gone,
        "dying_ms": 1000 * (dead_at - signalled_at),
        "left": len(left),
        "rows_while_dying": sum(signalled_at < at <= dead_at for at in stamps),
        "rows_after": sum(at > dead_at for at in stamps),
        "status": status.get("status", "none"),
    }


def run_trial(out: Path) -> dict[str, Any]:
    folder = out / "run"
    command = [sys.executable, "-m", "fedguard", "run", "experiments/quickstart.toml", "--out", str(folder), *RUN]
    return killed(command, folder, out / "run.log", running_programs())


def sweep_trial(out: Path) -> dict[str, Any]:
    preset = out / "sweep.toml"
    preset.write_text(SWEEP)
    command = [sys.executable, "-m", "fedguard", "sweep", str(preset), "--out", str(out / "sweep")]
    trial = killed(command, out / "sweep" / "run" / "none", out / "sweep.log", running_programs())
    again = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900)
    rows = [json.loads(line) for line in (out / "sweep" / "runs.jsonl").read_text().splitlines()]
    trial["again"] = (
        again.returncode == 0
        and "resuming it" in again.stdout
        and "finished earlier" not in again.stdout
        and [row["status"] for row in rows] == ["ok", "ok"]
    )
    return trial


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="SIGKILLs of fedguard run (default 10)")
    parser.add_argument("--sweeps", type=int, default=5, help="SIGKILLs of fedguard sweep (default 5)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-kill-trials")
    args = parser.parse_args()
    results: list[tuple[str, dict[str, Any]]] = []
    plan = [("run", run_trial)] * args.runs + [("sweep", sweep_trial)] * args.sweeps
    print(
        "| trial | killed | cores | dying (ms) | gone after (s) | processes left | rows while it died "
        "| rows after its death | status | again |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---:|---|---|")
    for number, (kind, trial) in enumerate(plan, 1):
        busy = number % 2 == 0
        out = args.out / f"{number:02d}-{kind}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        with busy_cores(busy):
            result = trial(out)
        results.append((kind, result))
        again = "-" if "again" not in result else "completed" if result["again"] else "**no**"
        print(
            f"| {number} | fedguard {kind} | {'busy' if busy else 'idle'} | {result['dying_ms']:.0f} | "
            f"{result['gone_s']:.1f} | {result['left']} | {result['rows_while_dying']} | {result['rows_after']} | "
            f"{result['status']} | {again} |",
            flush=True,
        )
    worst = max(r["gone_s"] for _, r in results)
    bad = [
        r for _, r in results if r["left"] or r["rows_after"] or r["status"] != "interrupted" or r.get("again") is False
    ]
    print(
        f"\nslowest end {worst:.1f} s after a SIGKILL; {len(bad)} of {len(results)} trials left a process, a row "
        "after the kill, another status, or a sweep that did not complete"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
