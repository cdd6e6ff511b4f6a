"""The process a run belongs to, as each process of the run knows it: no row is written once it is gone.

``fedguard run``'s launcher puts ``OWNER_ENV`` (its process id and start time) in the environment of every
process of its run, after the owners it belongs to itself: the ``fedguard sweep``, warm runner or Python
process that started it (``fedguard.runtime.lifeline.tied``), so the entry is a chain, ``pid:start,pid:start``.
Should one of them die (SIGKILL), the run's watcher (``fedguard.runtime.supervisor``) freezes and kills the
run's processes, which takes a moment; a process that would write a row meanwhile checks ``gone`` first
(``fedguard.store.folder.JsonlAppender``) and ends itself instead (``stop_here``), so that no row is written
after any process the run belongs to died. Standard library only; reads ``/proc``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

OWNER_ENV = "FEDGUARD_RUN_OWNER"
PROC = Path("/proc")


def process_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks after boot) of ``pid`` from ``/proc/<pid>/stat``, or None
    when it is gone."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after "pid (name)", which may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[19])


def alive(pid: int, started: int) -> bool:
    """Whether the process ``pid`` that started at ``started`` (clock ticks after boot) runs: that very one, not a
    later holder of its pid; a zombie does not."""
    stat = process_stat(pid)
    return stat is not None and stat[2] == started and stat[0] != "Z"


def owner_entry() -> dict[str, str]:
    """The environment entry naming this process, after the owners it belongs to itself, as an owner of what its
    children run (empty where there is no ``/proc``)."""
    stat = process_stat(os.getpid())
    if stat is None:
        return {}
    chain = [entry for entry in os.environ.get(OWNER_ENV, "").split(",") if entry]
    return {OWNER_ENV: ",".join([*chain, f"{os.getpid()}:{stat[2]}"])}


def gone() -> bool:
    """Whether this process belongs to an owner that has died (False for one that belongs to none)."""
    for entry in os.environ.get(OWNER_ENV, "").split(","):
        pid, _, started = entry.partition(":")
        if pid.isdigit() and started.isdigit() and not alive(int(pid), int(started)):
            return True
    return False


def stop_here() -> None:
    """End this process at once (SIGKILL): its run's owner died and the watcher is stopping the run."""
    os.kill(os.getpid(), signal.SIGKILL)
