"""The watcher that ends a run whose ``fedguard run`` died without stopping it (SIGKILL, a closed terminal, a CI
job's timeout).

``fedguard.runtime.launcher`` starts it before anything else of the run, in a session of its own (so a signal to the
launcher's process group does not reach it), with a lifeline: its standard input is a pipe whose write end only
the launcher holds. The watcher also holds the run folder's lock (``fedguard.store.lock``), and every process of
the run inherits ``RUN_TOKEN_ENV`` in its environment (SuperLink, SuperExec, the simulation and its Ray
cluster alike). When the launcher ends its run it writes ``DONE`` and the watcher exits. When the pipe closes
without it (the launcher died), the watcher stops every process whose environment holds the run's token
(SIGTERM, then SIGKILL ``GRACE`` seconds later, until none is left), writes ``interrupted`` to ``status.json``
unless the run wrote its ending since the watcher started, and exits, which releases the lock. Standard library
only.
"""

from __future__ import annotations

import os
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
GRACE = 3.0  # seconds the run's processes get between SIGTERM and SIGKILL
LATE_GRACE = 0.5  # seconds a process found on a later pass gets (one started while the others stopped)
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


def stop_run(token: str, grace: float = GRACE) -> int:
    """Stop every process of the run (``run_processes``; one found once is followed until it ends): SIGTERM when
    first found, SIGKILL ``grace`` seconds later (``LATE_GRACE`` for those found after the first pass: Ray may
    start workers while it stops), SIGKILL again each pass while one still runs. Returns how many there were, once
    none has run for ``QUIET`` seconds (or after ``GIVE_UP`` seconds)."""
    termed: dict[Process, float] = {}  # process -> monotonic time of its SIGKILL deadline
    start = time.monotonic()
    last_seen = start
    while time.monotonic() - start < GIVE_UP:
        now = time.monotonic()
        running = {p for p in run_processes(token) | termed.keys() if is_running(p)}
        found = running - termed.keys()
        signal_all(found, signal.SIGTERM)
        signal_all({p for p in running - found if now >= termed[p]}, signal.SIGKILL)
        patience = min(grace, LATE_GRACE) if termed else grace
        termed.update(dict.fromkeys(found, now + patience))
        if running:
            last_seen = now
        elif now - last_seen >= QUIET:
            break
        time.sleep(0.1)
    return len(termed)


def rounds_done(folder: Path) -> int:
    """The last round in the run's ``rounds.jsonl`` (0 when none, or when it cannot be read)."""
    try:
        rows = read_rounds(folder, note=lambda _: None)
    except RunFileError:
        return 0
    return max((row["round"] for row in rows if isinstance(row.get("round"), int)), default=0)


def watch(folder: Path, token: str, launcher: int) -> int:
    """Wait for the lifeline on standard input to close; when the launcher (process ``launcher``) died without
    ending its run, stop the run and record it as interrupted. Returns the exit code."""
    status = folder / STATUS_FILE
    before = _identity(status)
    if sys.stdin.buffer.read() == DONE:
        return 0
    start = time.monotonic()
    count = stop_run(token)
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
    """``python -m fedguard.runtime.supervisor RUN_DIR TOKEN LAUNCHER_PID`` (started by
    ``fedguard.runtime.launcher``)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or not args[2].isdigit():
        print(
            "usage: python -m fedguard.runtime.supervisor RUN_DIR TOKEN LAUNCHER_PID (started by fedguard run)",
            file=sys.stderr,
        )
        return 2
    return watch(Path(args[0]), args[1], int(args[2]))


if __name__ == "__main__":
    sys.exit(main())
