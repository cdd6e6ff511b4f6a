"""The watcher that ends a run whose ``fedguard run`` died without stopping it (SIGKILL, a closed terminal, a CI
job's timeout).

``fedguard.runtime.launcher`` starts it before anything else of the run, in a session of its own (so a signal to the
launcher's process group does not reach it), with a lifeline: its standard input is a pipe whose write end only
the launcher holds. The watcher also holds the run folder's lock (``fedguard.store.lock``), and every process of
the run inherits ``RUN_TOKEN_ENV`` in its environment (SuperLink, SuperExec, the simulation and its Ray
cluster alike). When the launcher ends its run it writes ``DONE`` and the watcher exits. When the pipe closes
without it (the launcher died), the watcher stops every process whose environment holds the run's token
(each frozen with SIGSTOP when found, so that none writes anything more, then all killed with SIGKILL, until
none is left), writes ``interrupted`` to ``status.json`` unless the run wrote its ending since the watcher
started, removes the run's temporary Flower home, and exits, which releases the lock. Standard library only.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

from fedguard.report.run_status import write_status
from fedguard.runtime.processes import Process, descendants, is_running, marked, signal_all
from fedguard.store.folder import STATUS_FILE, RunFileError
from fedguard.store.rows import read_rounds

RUN_TOKEN_ENV = "FEDGUARD_RUN_TOKEN"
DONE = b"done"  # what the launcher writes on the lifeline when it ended its run itself
QUIET = 0.5  # seconds with no process of the run left that end the stop
GIVE_UP = 60.0  # seconds after which the stop returns even if a process of the run still runs (one in state D)


def _identity(path: Path) -> tuple[int, int] | None:
    """(inode, modification time in ns) of ``path``, or None when there is none: a rewrite changes it."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns


def run_processes(token: str) -> set[Process]:
    """The processes whose environment holds ``RUN_TOKEN_ENV=token`` and every process below them: Ray's agents
    rename themselves (``setproctitle``) over the start of their environment, so that only their parent, the
    raylet, still shows the token."""
    found = marked(f"{RUN_TOKEN_ENV}={token}")
    for process in list(found):
        found |= descendants(process.pid)
    return {p for p in found if p.pid != os.getpid()}


def stop_run(token: str) -> int:
    """Stop every process of the run (``run_processes``) without letting one write anything more: each is frozen
    (SIGSTOP) as soon as it is found, so that none writes a row or starts a process while the others are looked
    for, and once a pass finds no new one, all are killed (SIGKILL; a frozen process dies of it too). Returns
    how many there were, once none has run for ``QUIET`` seconds (or after ``GIVE_UP`` seconds)."""
    frozen: set[Process] = set()
    start = time.monotonic()
    last_seen = start
    while time.monotonic() - start < GIVE_UP:
        now = time.monotonic()
        found = {p for p in run_processes(token) if is_running(p)} - frozen
        signal_all(found, signal.SIGSTOP)
        frozen |= found
        running = {p for p in frozen if is_running(p)}
        if not found:  # the whole run frozen: nothing of it can start anything now
            signal_all(running, signal.SIGKILL)
        if running:
            last_seen = now
        elif now - last_seen >= QUIET:
            break
        time.sleep(0.05)
    return len(frozen)


def rounds_done(folder: Path) -> int:
    """The last round in the run's ``rounds.jsonl`` (0 when none, or when it cannot be read)."""
    try:
        rows = read_rounds(folder, note=lambda _: None)
    except RunFileError:
        return 0
    return max((row["round"] for row in rows if isinstance(row.get("round"), int)), default=0)


def watch(folder: Path, token: str, launcher: int, home: Path | None = None) -> int:
    """Wait for the lifeline on standard input to close; when the launcher (process ``launcher``) died without
    ending its run, stop the run, record it as interrupted and remove the run's temporary ``home`` (its private
    Flower home), which the launcher would have removed. Returns the exit code."""
    status = folder / STATUS_FILE
    before = _identity(status)
    if sys.stdin.buffer.read() == DONE:
        return 0
    start = time.monotonic()
    count = stop_run(token)
    if home is not None:
        shutil.rmtree(home, ignore_errors=True)
    ending = ""
    if _identity(status) == before:
        write_status(
            folder,
            "interrupted",
            rounds_done(folder),
            f"fedguard run (process {launcher}) ended without stopping the run",
        )
        ending = f"; {status}: interrupted"
    try:
        print(
            f"fedguard: fedguard run (process {launcher}) ended without stopping its run: stopped its {count} "
            f"processes in {time.monotonic() - start:.1f} s{ending}",
            file=sys.stderr,
            flush=True,
        )
    except OSError:  # the terminal went with the launcher
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m fedguard.runtime.supervisor RUN_DIR TOKEN LAUNCHER_PID [HOME]`` (started by
    ``fedguard.runtime.launcher``)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (3, 4) or not args[2].isdigit():
        print(
            "usage: python -m fedguard.runtime.supervisor RUN_DIR TOKEN LAUNCHER_PID [HOME] (started by fedguard run)",
            file=sys.stderr,
        )
        return 2
    return watch(Path(args[0]), args[1], int(args[2]), Path(args[3]) if len(args) == 4 else None)


if __name__ == "__main__":
    sys.exit(main())
