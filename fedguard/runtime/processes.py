"""The processes a run starts, found through ``/proc``, so that ``fedguard run`` leaves none behind.

A process is known by its pid and its start time, so a pid the system hands to another process later is never
taken for it. Where there is no ``/proc`` nothing is found, and only the process groups ``fedguard run``
started itself are stopped. ``marked`` finds a run's processes by a variable of their environment, which every
process the run starts inherits, whoever its parent is now.
"""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from fedguard.run_owner import PROC, alive, process_stat


@dataclass(frozen=True)
class Process:
    """One process: its pid and its start time (clock ticks after boot)."""

    pid: int
    started: int


def descendants(root: int) -> set[Process]:
    """Every process below ``root`` in the process tree now."""
    children: dict[int, list[Process]] = defaultdict(list)
    for entry in PROC.glob("[0-9]*"):
        stat = process_stat(int(entry.name))
        if stat is not None:
            children[stat[1]].append(Process(int(entry.name), stat[2]))
    found: set[Process] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child.pid)
    return found


def _having(name: str, matches: Callable[[bytes], bool]) -> set[Process]:
    """Every process now, but this one, whose ``/proc/<pid>/<name>`` ``matches``; one whose file cannot be read
    (another user's, one gone meanwhile) is not."""
    found: set[Process] = set()
    for path in PROC.glob("[0-9]*"):
        pid = int(path.name)
        try:
            content = (path / name).read_bytes()
        except OSError:
            continue
        stat = process_stat(pid)
        if pid != os.getpid() and stat is not None and matches(content):
            found.add(Process(pid, stat[2]))
    return found


def marked(marker: str) -> set[Process]:
    """Every process now whose environment holds the entry ``marker`` (``NAME=value``), but this one; one whose
    environment cannot be read (another user's, a zombie's) is not."""
    entry = marker.encode()
    return _having("environ", lambda environ: entry in environ.split(b"\0"))


def running_programs(word: bytes = b"python") -> set[Process]:
    """Every live process now whose command line holds ``word``, but this one: fedguard's, Flower's and Ray's
    processes all run Python, so what a run left behind is what this finds after it and not before it."""
    return {p for p in _having("cmdline", lambda command: word in command) if is_running(p)}


def is_running(process: Process) -> bool:
    """Whether ``process`` (that very one, not a later holder of its pid) still runs; a zombie does not."""
    return alive(process.pid, process.started)


def signal_all(processes: set[Process], signum: int) -> None:
    """Send ``signum`` to each of ``processes``; one gone meanwhile, or not ours, is skipped."""
    for process in processes:
        try:
            os.kill(process.pid, signum)
        except OSError:  # gone meanwhile, or not ours to signal
            pass


def _wait(processes: set[Process], seconds: float) -> set[Process]:
    """Those of ``processes`` still running after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    running = {p for p in processes if is_running(p)}
    while running and time.monotonic() < deadline:
        time.sleep(0.1)
        running = {p for p in running if is_running(p)}
    return running


@dataclass
class ProcessTracker:
    """The processes ``watch`` was given and every process seen below them (``update`` while the run goes:
    one that loses its parent is still known), and how to stop those still running at the end."""

    roots: set[Process] = field(default_factory=set)
    seen: set[Process] = field(default_factory=set)

    def watch(self, pid: int) -> None:
        """Track process ``pid`` and what it starts."""
        stat = process_stat(pid)
        if stat is not None:
            self.roots.add(Process(pid, stat[2]))
            self.seen.add(Process(pid, stat[2]))

    def update(self) -> None:
        """Add the processes below the tracked ones now (below those still running: a pid given to another
        process since is not followed)."""
        for root in [r for r in self.roots if is_running(r)]:
            self.seen |= descendants(root.pid)

    def stop(self, patience: float, grace: float = 5.0) -> set[Process]:
        """Give the processes seen up to ``patience`` seconds to end on their own, then SIGTERM, ``grace``
        seconds later SIGKILL; returns those still running after that."""
        running = _wait(self.seen, patience)
        signal_all(running, signal.SIGTERM)
        running = _wait(running, grace)
        signal_all(running, signal.SIGKILL)
        return _wait(running, grace)
