"""The process side of ``fedguard run``: a private SuperLink, ``flwr run`` on it, signals, and the cleanup.

``fedguard.runtime.simulation.prepare`` turns a checked configuration into a ``Launch`` (strings only); ``launch``
runs it. ``fedguard run`` hands the ``Launch`` to ``python -m fedguard.runtime.launcher`` in place of itself
(``os.execv``, same process id), so the process that waits for the whole run holds neither torch nor the
configuration's registries (about 0.5 GB less for a run's lifetime). This module imports only the standard
library and fedguard's light process helpers.

A private SuperLink is started on loopback, in simulation mode, with runtime dependency installation off and
its state and Flower home in the launch's temporary folder; the app is started on it with ``flwr run``, the
run's logs are streamed here, and the SuperLink is stopped at the end. The ServerApp writes ``status.json``
in the run folder (``fedguard.report.run_status``); the run's exit code comes from it, since
``flwr run --stream`` ends the same way whether a run completed or failed.

The run folder is locked for the run's life (``fedguard.store.lock``: a second writer is refused), and a watcher
(``fedguard.runtime.supervisor``) started before anything else stops the run and records it as interrupted when this
process dies without ending it (SIGKILL): every process of the run carries the run's token in its environment.

The first SIGINT or SIGTERM asks the run to stop (the stop file the ServerApp watches, ``STOP_FILE_ENV``):
the attacks still running are recorded as interrupted, the report is written, and ``launch`` raises
``Interrupted``; a second signal, or a run that has not ended ``STOP_GRACE`` seconds later, is stopped at
once. Either way every process the run started is stopped (``fedguard.runtime.processes``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import IO, Any

from fedguard import run_owner
from fedguard.report.run_status import read_status
from fedguard.runtime import lifeline
from fedguard.runtime.processes import ProcessTracker
from fedguard.runtime.supervisor import DONE, RUN_TOKEN_ENV
from fedguard.store.folder import write_atomic
from fedguard.store.lock import RunFolderBusy, hold

STOP_FILE_ENV = "FEDGUARD_STOP_FILE"
CONNECTION = "fedguard-local"
STOP_GRACE = 60.0  # seconds a stopped run gets to record its attacks and write its report
SETTLE_SECONDS = 10.0  # seconds the run's processes get to end on their own once it is over
ROUNDS_FILE = "rounds.jsonl"


@dataclasses.dataclass(frozen=True)
class Launch:
    """One run to start: the app folder, the run folder, the temporary Flower ``home`` (holding
    ``run-config.toml``), the processes' environment, ``flwr run``'s ``--federation-config``, whether Flower's
    own INFO lines are shown, and when the run was asked for (``time.time()``, for the closing line)."""

    app_dir: str
    out_dir: str
    home: str
    env: dict[str, str]
    federation: str
    verbose: bool = False
    asked_at: float = 0.0

    def save(self) -> Path:
        """Write the launch into its home; returns the file."""
        path = Path(self.home) / "launch.json"
        path.write_text(json.dumps(dataclasses.asdict(self)))
        return path

    @classmethod
    def load(cls, path: Path) -> Launch:
        return cls(**json.loads(path.read_text()))


class LaunchError(RuntimeError):
    """The private SuperLink or ``flwr run`` could not start, or the run did not complete."""


class PluginFailed(LaunchError):
    """The run stopped because a ``server.plugins`` module's code raised or exited (``status.json`` names it):
    ``fedguard run`` exits 2, as for a plugin refused on import."""


class Interrupted(RuntimeError):
    """``fedguard run`` was stopped by a signal; ``exit_code`` is 128 + its number, as a shell reports it."""

    def __init__(self, signum: int, folder: Path, status: dict[str, Any] | None) -> None:
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        if status is None:
            super().__init__(f"stopped by {name} before the run started")
        else:
            super().__init__(
                f"stopped by {name} after {status['rounds']} rounds; the results so far and the report are in {folder}"
            )


def free_port() -> int:
    """A TCP port free on loopback now (the system's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, process: subprocess.Popen[Any], timeout: float, log_file: Path, stop: SignalStop) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and stop.signum is None:
        if process.poll() is not None:
            raise LaunchError(
                f"the private SuperLink exited with code {process.returncode}:\n{log_file.read_text()[-2000:]}"
            )
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    if stop.signum is None:
        raise LaunchError(
            f"the private SuperLink did not listen on 127.0.0.1:{port} within {timeout:.0f} s; its log: {log_file}"
        )


class SignalStop:
    """SIGINT and SIGTERM while a run goes: the first asks the run to stop (writes the signal's name into
    ``stop_file``, which the ServerApp watches); a second one, or ``STOP_GRACE`` seconds after the first,
    makes ``hurried`` true: stop it at once."""

    def __init__(self, stop_file: Path) -> None:
        self.stop_file = stop_file
        self.signals: list[int] = []
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalStop:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    @property
    def signum(self) -> int | None:
        """The first signal received, or None."""
        return self.signals[0] if self.signals else None

    def hurried(self) -> bool:
        """Whether to stop at once: a second signal came, or the first ``STOP_GRACE`` seconds ago."""
        return len(self.signals) > 1 or (bool(self.signals) and time.monotonic() - self._first_at > STOP_GRACE)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.signals.append(signum)
        name = signal.Signals(signum).name
        if len(self.signals) == 1:
            self._first_at = time.monotonic()
            with contextlib.suppress(OSError):  # a failed write must not raise inside whatever was interrupted
                write_atomic(self.stop_file, name)  # whole or not at all: the run reads the signal's name
            _say(
                f"{name}: stopping the run: the attacks still running are recorded as interrupted and the "
                "report is written (send the signal again to stop at once)"
            )
        elif len(self.signals) == 2:
            _say(f"{name} again: stopping at once")


def _say(message: str) -> None:
    """Write a line to stderr without Python's buffers (safe from a signal handler)."""
    os.write(sys.stderr.fileno(), f"\nfedguard: {message}\n".encode())


def launch(plan: Launch) -> Path:
    """Run ``plan`` to its end; returns the run folder. Raises ``Interrupted`` when a signal stopped it,
    ``LaunchError`` when the run did not complete, ``RunFolderBusy`` when another run writes its folder. The
    launch's home is removed at the end."""
    home = Path(plan.home)
    try:
        lock = hold(Path(plan.out_dir))
        try:
            signum = _supervised(plan, lock)
        finally:
            os.close(lock)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return ending(Path(plan.out_dir), signum)


def _supervised(plan: Launch, lock: int) -> int | None:
    """Run ``plan`` under a watcher (``fedguard.runtime.supervisor``) that holds ``lock`` too and stops the run should
    this process die; returns the signal that stopped the run, or None."""
    with watched(plan.out_dir, lock, plan.env, plan.home) as token:
        return _run(plan, {**plan.env, RUN_TOKEN_ENV: token, **run_owner.owner_entry()})


@contextlib.contextmanager
def watched(out_dir: str, lock: int, env: dict[str, str], home: str | None = None) -> Iterator[str]:
    """A watcher (``fedguard.runtime.supervisor``) of the run writing ``out_dir`` while the block runs: it holds
    ``lock`` too, and should this process die before the block ends, it stops the processes carrying the token
    yielded (``RUN_TOKEN_ENV``), records the run as interrupted and removes the run's temporary ``home``."""
    token = secrets.token_hex(16)
    watcher = subprocess.Popen(
        [sys.executable, "-m", "fedguard.runtime.supervisor", out_dir, token, str(os.getpid()), *filter(None, [home])],
        stdin=subprocess.PIPE,
        env=env,
        pass_fds=(lock,),
        start_new_session=True,
    )
    assert watcher.stdin is not None
    try:
        yield token
    finally:
        with contextlib.suppress(OSError):
            watcher.stdin.write(DONE)
            watcher.stdin.close()
        watcher.wait()


def superlink_command(port: int, database: Path, program: str = "flower-superlink") -> list[str]:
    """The command of a private simulation SuperLink: loopback ``port`` only (hence no TLS), its state in
    ``database``, no app dependency installed at run time; ``program`` is ``flower-superlink`` or its path."""
    return [
        program,
        "--insecure",
        "--simulation",
        "--disable-runtime-dependency-installation",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--database",
        str(database),
    ]


def write_flower_home(home: Path, port: int, connection: str = CONNECTION) -> None:
    """``home/config.toml``: a Flower home whose default connection ``connection`` is the private SuperLink on
    loopback ``port``."""
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{connection}"\n\n[superlink.{connection}]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n'
    )


def _run(plan: Launch, env: dict[str, str]) -> int | None:
    """Start the private SuperLink and the app on it with ``env``, wait for the run and stop what it started;
    returns the signal that stopped it, or None."""
    home = Path(plan.home)
    port = free_port()
    write_flower_home(home, port)
    log_file = home / "superlink.log"
    command = superlink_command(port, home / "state.db")
    tracker = ProcessTracker()
    with SignalStop(Path(env[STOP_FILE_ENV])) as stop:
        with open(log_file, "w") as log:
            superlink = subprocess.Popen(
                command, env=env, cwd=home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        tracker.watch(superlink.pid)
        try:
            _wait_for_port(port, superlink, 60, log_file, stop)
            if stop.signum is None:
                run = [
                    "flwr",
                    "run",
                    plan.app_dir,
                    CONNECTION,
                    "--federation-config",
                    plan.federation,
                    "--run-config",
                    str(home / "run-config.toml"),
                    "--stream",
                ]
                _stream(run, env, home, plan.verbose, stop, tracker)
        finally:
            _shut_down(superlink, tracker, stop)
    return stop.signum


def ending(folder: Path, signum: int | None) -> Path:
    """``folder`` when its run completed; ``Interrupted`` when ``signum`` stopped it; else ``LaunchError``
    (``PluginFailed`` when a plugin's code stopped it)."""
    status = read_status(folder)
    if signum is not None:
        raise Interrupted(signum, folder, status)
    if status is None:
        raise LaunchError(f"the run stopped before its ServerApp started or wrote {folder}/status.json")
    if status["status"] != "completed":
        failure = PluginFailed if status.get("plugin") else LaunchError
        raise failure(f"the run ended as {status['status']!r}: {status.get('error', '')}")
    return folder


def _stream(
    command: list[str], env: dict[str, str], cwd: Path, verbose: bool, stop: SignalStop, tracker: ProcessTracker
) -> None:
    """Run ``command`` (in its own session: signals reach it through the stop request only), printing its
    output (Flower's own INFO lines only when ``verbose``) and noting the processes the run starts, until it
    ends or ``stop`` is hurried."""
    process = subprocess.Popen(
        command,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    tracker.watch(process.pid)
    assert process.stdout is not None
    printer = threading.Thread(target=_print_output, args=(process.stdout, verbose), daemon=True)
    printer.start()
    try:
        while not stop.hurried():
            tracker.update()
            try:
                process.wait(0.5)
                break
            except subprocess.TimeoutExpired:
                pass
    finally:
        _stop(process, grace=5.0)
        printer.join(5)
    if process.returncode != 0 and stop.signum is None:
        raise LaunchError(f"`{' '.join(command[:3])} ...` exited with code {process.returncode}")


def _print_output(stream: IO[str], verbose: bool) -> None:
    """Print the lines of ``stream`` as they come, but Flower's own INFO lines unless ``verbose``."""
    for line in stream:
        if verbose or not is_flower_chatter(line):
            print(line, end="", flush=True)


def is_flower_chatter(line: str) -> bool:
    """Flower's INFO log lines (round banners, sampling), shown with ``--verbose`` only."""
    return line.lstrip().startswith(("INFO :", "\x1b[92mINFO", "DEBUG :")) or not line.strip()


def _shut_down(superlink: subprocess.Popen[Any], tracker: ProcessTracker, stop: SignalStop) -> None:
    """Stop the SuperLink, then every process the run started that is still running: given ``SETTLE_SECONDS``
    to end on their own (none when ``stop`` is hurried), then terminated."""
    tracker.update()
    _stop(superlink, grace=5.0 if stop.hurried() else 20.0)
    left = tracker.stop(patience=0.0 if stop.hurried() else SETTLE_SECONDS)
    if left:
        _say(f"processes of the run still running after SIGKILL: {sorted(p.pid for p in left)}")


def _stop(process: subprocess.Popen[Any], grace: float = 20.0) -> None:
    """Stop ``process`` and everything in its process group (it leads its own session): SIGTERM, then SIGKILL
    after ``grace`` seconds."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def main(argv: list[str] | None = None) -> int:
    """``python -m fedguard.runtime.launcher LAUNCH_JSON``: run the launch, print how it ended; the exit code is 0,
    1 (the run failed), 2 (another run writes the folder, or a plugin's code stopped the run) or 128 + the signal
    that stopped it."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fedguard.runtime.launcher LAUNCH_JSON (written by fedguard run)", file=sys.stderr)
        return 2
    lifeline.hold()  # a fedguard sweep or fedguard.run that started this run: it ends with them
    plan = Launch.load(Path(args[0]))
    return exit_code(lambda: launch(plan), plan.asked_at)


def exit_code(run: Callable[[], Path], asked_at: float, failures: tuple[type[Exception], ...] = (LaunchError,)) -> int:
    """Call ``run`` and print how it ended, as ``fedguard run`` does; the exit code: 0, 1 (one of ``failures``),
    2 (another run writes the folder, or a plugin's code stopped the run) or 128 + the signal that stopped it
    (``asked_at``: ``time.time()`` when the run was asked for)."""
    try:
        folder = run()
    except (RunFolderBusy, PluginFailed) as refused:
        print(f"fedguard: {refused}", file=sys.stderr, flush=True)
        return 2
    except Interrupted as stopped:
        print(f"fedguard: {stopped}", file=sys.stderr, flush=True)
        return stopped.exit_code
    except failures as error:
        print(f"fedguard: {error}", file=sys.stderr, flush=True)
        return 1
    print(f"fedguard: done in {time.time() - asked_at:.1f} s; rounds in {folder / ROUNDS_FILE}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
