"""A plugin that fails, named: which plugin's code an error came from (the run names the module and the line that
raised, and stops as a plugin failure: ``fedguard run`` exits 2, as for a plugin refused on import), and a deadline
on a plugin's import.

A plugin is a module ``server.plugins`` names; its code is every file under the module's file or package folder.
An error is the plugin's when the innermost frame of its traceback that lies in any plugin's code does (the frames
below it are fedguard's, torch's or Flower's, called by the plugin).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType


@dataclass(frozen=True)
class PluginFrame:
    """A line of a plugin's code: its module (as ``server.plugins`` names it), file, line number and function."""

    module: str
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


class PluginFailure(Exception):
    """A run stopped because a plugin's code raised or called ``sys.exit``; the message names the module, what it
    raised and the line."""

    def __init__(self, frame: PluginFrame, error: BaseException) -> None:
        self.frame = frame
        super().__init__(plugin_reason(frame, error))


def plugin_reason(frame: PluginFrame, error: BaseException) -> str:
    """One line: which plugin did what, where (``server.plugins module 'x' raised ValueError: ... (at x.py:3 in
    f)``)."""
    if isinstance(error, SystemExit):
        what = f"called sys.exit({error.code!r})"
    else:
        what = f"raised {type(error).__name__}: {error}"
    return f"server.plugins module {frame.module!r} {what} (at {frame})"


def plugin_roots(modules: list[str]) -> dict[str, Path]:
    """Each imported module of ``modules`` -> its code: the package folder of a package, else its file. Modules not
    imported in this process, or without a file, are left out."""
    roots = {}
    for name in modules:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file is None:
            continue
        path = Path(file).resolve()
        roots[name] = path.parent if path.name == "__init__.py" else path
    return roots


def _owner(file: str, roots: dict[str, Path]) -> str | None:
    """The plugin whose code holds ``file``, or None."""
    path = Path(file).resolve()
    for module, root in roots.items():
        if path == root or root in path.parents:
            return module
    return None


def _innermost(frames: list[tuple[str, int, str]], roots: dict[str, Path]) -> PluginFrame | None:
    """The last of ``frames`` (file, line, function; outermost first) in a plugin's code."""
    for file, line, function in reversed(frames):
        module = _owner(file, roots)
        if module is not None:
            return PluginFrame(module, file, line, function)
    return None


def raising_plugin(error: BaseException, modules: list[str]) -> PluginFrame | None:
    """The line of a plugin among ``modules`` that ``error`` was raised from (module docstring), following its
    ``__cause__`` and ``__context__`` too; None when no frame of its traceback is a plugin's."""
    roots = plugin_roots(modules)
    if not roots:
        return None
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        found = _innermost(_tb_frames(current.__traceback__), roots)
        if found is not None:
            return found
        current = current.__cause__ or current.__context__
    return None


def running_plugin(frame: FrameType | None, modules: list[str]) -> PluginFrame | None:
    """The innermost line of a plugin among ``modules`` that the stack ending at ``frame`` is running (a thread's
    frame from ``sys._current_frames()``), or None."""
    roots = plugin_roots(modules)
    if frame is None or not roots:
        return None
    stack = [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_stack(frame)]
    return _innermost(stack, roots)


def _tb_frames(tb: TracebackType | None) -> list[tuple[str, int, str]]:
    return [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(tb)]


class PluginImportHangs(Exception):
    """Importing a plugin did not end within its deadline (``import_deadline``)."""


@contextlib.contextmanager
def import_deadline(module: str, seconds: float) -> Iterator[None]:
    """Raise ``PluginImportHangs`` in the code running here once ``seconds`` have passed (a timer signal, so only
    in the main thread; elsewhere, e.g. in a simulation's actor, no deadline is set). A deadline of its own that the
    caller set is put back afterwards, less the time spent here."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: FrameType | None) -> None:
        raise PluginImportHangs(f"importing {module!r} did not end within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    left, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if left:
            signal.setitimer(signal.ITIMER_REAL, max(left - (time.monotonic() - started), 1e-3))
