"""A process that dies with the process that started it, however that one died (SIGKILL included).

The parent starts the child with ``tied()`` in its environment and standard input a pipe whose write end only
the parent holds (``subprocess.PIPE``: Python makes its end non-inheritable, so no other child holds it). The
system closes that end when the parent dies, and the child, which called ``hold`` (or reads its standard input
itself and calls ``cut`` at its end), kills itself with SIGKILL there. What the child ran is then ended as a
``fedguard run`` killed with SIGKILL is: its watcher (``fedguard.runtime.supervisor``) stops the run's
processes and records the run as interrupted. ``fedguard sweep`` ties each run (a ``fedguard run`` process or
its warm runner) to itself this way, and ``fedguard.run`` ties its ``fedguard run`` process to the Python
process that called it. Standard library only.
"""

from __future__ import annotations

import os
import signal
import threading

from fedguard import run_owner

LIFELINE_ENV = "FEDGUARD_LIFELINE"
STDIN = "stdin"  # its value: standard input is the lifeline
STDIN_FD = 0


def tied() -> dict[str, str]:
    """The environment entries that make a child ``hold`` its standard input as its lifeline and name this
    process among its run's owners (``fedguard.run_owner``), so that no row of its run is written once this
    process is gone, even before the child has seen its lifeline end."""
    return {LIFELINE_ENV: STDIN, **run_owner.owner_entry()}


def is_tied() -> bool:
    """Whether this process was started with a lifeline on its standard input (``tied``)."""
    return os.environ.get(LIFELINE_ENV) == STDIN


def cut() -> None:
    """End this process at once, as its parent's death asks: SIGKILL, so that its watcher, not a cleanup that may
    write rows, ends what it ran."""
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_end() -> None:
    """Read standard input to its end (nothing is sent on it), then ``cut``. It reads the descriptor itself, not
    ``sys.stdin``, whose buffer lock a thread blocked in it would hold while the interpreter shuts down."""
    try:
        while os.read(STDIN_FD, 4096):
            pass
    except OSError:  # closed or unreadable: the pipe is gone either way
        pass
    cut()


def hold() -> bool:
    """When this process is ``is_tied``, watch its standard input in a daemon thread and ``cut`` at its end;
    returns whether it does. ``LIFELINE_ENV`` is removed from this process's environment, so that what it starts
    is not tied to it this way."""
    if not is_tied():
        return False
    os.environ.pop(LIFELINE_ENV, None)
    threading.Thread(target=_wait_for_end, name="fedguard-lifeline", daemon=True).start()
    return True
