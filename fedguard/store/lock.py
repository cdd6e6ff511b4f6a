"""One writer per run folder: ``fedguard run`` holds ``run.lock`` in the folder for the run's life.

The lock is ``fcntl.flock`` on that file, which also holds the writer's process id. The system releases it
once every process holding it has ended (the launcher and its watcher, ``fedguard.runtime.supervisor``), however they
ended, so a writer that died leaves nothing that blocks. A second writer (``fedguard run --resume`` or a new
run into the folder) is refused with ``RunFolderBusy``, naming the holder's process id.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from fedguard.store.folder import LOCK_FILE


class RunFolderBusy(FileExistsError):
    """A live ``fedguard run`` writes the run folder; the message names its process id."""


def hold(folder: Path) -> int:
    """Lock ``folder`` (created if need be) for this process; returns the lock's file descriptor: the lock is
    held until it and every copy of it (inherited, passed on) are closed. ``RunFolderBusy`` when another
    live process holds it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunFolderBusy(
            f"{folder} is being written by fedguard run (process {holder}); wait for it to end, "
            f"or stop it (kill -INT {holder}), before resuming it or starting another run "
            "there"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def wait_free(folder: Path, seconds: float, poll: float = 0.2) -> bool:
    """Whether ``folder``'s lock is free, waiting up to ``seconds`` for a process that holds it (a run's watcher
    still stopping it) to end; the lock is not kept. True when the folder has no lock file."""
    path = Path(folder) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    try:
        deadline = time.monotonic() + seconds
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(poll)
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
            return True
    finally:
        os.close(fd)
