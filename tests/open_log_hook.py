"""An audit hook (PEP 578) noting which code opens files under a watched folder, and which processes are
attack workers.

``Watch`` notes, for every file opened under its folder, the process, the path, the mode and the project
source files on the stack at that moment (``attackers/...``, ``clients/...``, ``fedguard/...``,
``strategies/...``, innermost first); and, once per process, that the process is an attack worker: it
unpickles the attack factories or the observations the attacker pool sends its workers. Standard library
only: copied as ``sitecustomize.py`` into a folder on ``PYTHONPATH``, it installs itself in every Python
process of a run (the folder and the log from ``WATCH_DIR_ENV`` and ``WATCH_LOG_ENV``); the log holds one
JSON object per line.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

WATCH_DIR_ENV = "FEDGUARD_WATCH_DIR"
WATCH_LOG_ENV = "FEDGUARD_WATCH_LOG"
PACKAGES = ("attackers", "clients", "fedguard", "strategies")
# What only an attack worker unpickles: the factories it builds its attacks with, the uploads it attacks.
WORKER_CLASSES = {("attackers.base", "build_attack"), ("fedguard.observation", "Observation")}


def project_frames(frame: FrameType | None) -> list[str]:
    """The project's source files on the stack from ``frame`` outwards, from their package folder on."""
    files = []
    while frame is not None:
        parts = Path(frame.f_code.co_filename).parts
        found = [i for i, part in enumerate(parts) if part in PACKAGES]
        if found:
            files.append("/".join(parts[found[-1] :]))
        frame = frame.f_back
    return files


def opened_path(args: tuple[Any, ...]) -> str | None:
    """The absolute path of an ``open`` event, or None for a file descriptor."""
    path = args[0]
    if isinstance(path, int):
        return None
    return os.path.abspath(os.fsdecode(os.fspath(path)))


class Watch:
    """The hook: ``note`` receives one record per open under ``folder`` and one when the process turns out to
    be an attack worker."""

    def __init__(self, folder: Path, note: Callable[[dict[str, Any]], None]) -> None:
        self.folder = os.path.abspath(folder) + os.sep
        self.note = note
        self.worker = False

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path = opened_path(args)
            if path is not None and path.startswith(self.folder):
                self.note(
                    {"pid": os.getpid(), "path": path, "mode": str(args[1]), "stack": project_frames(sys._getframe(1))}
                )
        elif event == "pickle.find_class" and not self.worker and tuple(args) in WORKER_CLASSES:
            self.worker = True
            self.note({"pid": os.getpid(), "worker": True})


def log_writer(log: Path) -> Callable[[dict[str, Any]], None]:
    """Appends records to ``log``, one JSON line each, in one write (whole lines from many processes)."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    return lambda record: os.write(fd, (json.dumps(record) + "\n").encode())


def install_from_environment() -> None:
    """Watch ``$FEDGUARD_WATCH_DIR`` into ``$FEDGUARD_WATCH_LOG`` when both are set."""
    folder, log = os.environ.get(WATCH_DIR_ENV), os.environ.get(WATCH_LOG_ENV)
    if folder and log:
        sys.addaudithook(Watch(Path(folder), log_writer(Path(log))))


install_from_environment()
