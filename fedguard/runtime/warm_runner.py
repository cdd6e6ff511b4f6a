"""The process of a warm runtime (``fedguard.runtime.warm``): it runs one run after another in itself, on Flower's
simulation engine and a Ray cluster that outlive the runs.

``python -m fedguard.runtime.warm_runner`` reads one request a line on standard input (JSON: ``plan``, the run
plan of a validated configuration (``fedguard.run_plan``, rebuilt here without validating it again), and
``out``, the run folder; or ``resume``, the folder of a stopped run to go on from its
checkpoint, as ``fedguard run --resume``; and ``log``, the file its output goes to) and answers each with one
line on standard output, ``{"code": N}``: 0 (completed), 1 (failed), 2 (another run writes the folder) or 128 +
the signal that stopped it, as ``fedguard run`` exits. It ends when standard input closes.

Each run is what ``fedguard run`` would run: the same checks (``fedguard.runtime.preflight``), the folder's lock
and a watcher that records the run as interrupted should this process die (``fedguard.runtime.launcher.watched``),
the same ServerApp and ClientApp bound to the run's configuration, and ``status.json`` deciding the code. What
this process saves each run: its own start (Python, torch, fedguard: about 4 s on 2 cores), the SuperLink's, the
``flwr run`` submission's and the simulation process's, and Ray's (the cluster is joined at ``RAY_ADDRESS``,
which the parent sets). The in-process entry of Flower's simulation engine it calls (``_run_simulation``, the
engine under Flower's own ``run_simulation`` that also takes the ServerApp's context) is private to Flower 1.41,
which the project pins.

Standard input is also the lifeline (``fedguard.runtime.lifeline``): when it closes while a run is served, the
parent died, and this process kills itself, so that the run's watcher records it as interrupted (``Requests``).

Signals: the first SIGINT during a run asks it to stop as ``fedguard run``'s do (the stop file the
ServerApp watches: attacks left are recorded as interrupted, the report is written); the parent sends SIGINT,
since Ray's driver, which this process becomes, ends itself on SIGTERM; it kills this process when a stopped run
does not end in time.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

from fedguard.config import Config
from fedguard.runtime import lifeline
from fedguard.runtime.launcher import STOP_FILE_ENV, SignalStop, ending, exit_code, watched
from fedguard.runtime.preflight import ready, resumed
from fedguard.store.lock import hold


def simulate_here(config: Config) -> None:
    """Run ``config`` (checked, its ``out-dir`` set) to its end on Flower's simulation engine in this process, its
    clients as actors of the Ray cluster at ``RAY_ADDRESS``."""
    from flwr.app import ConfigRecordValues
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.telemetry import EventType

    from fedguard.runtime.client_app import make_client_app
    from fedguard.runtime.server_app import make_server_app

    resources: dict[str, ConfigRecordValues] = {"num_cpus": config.sim.client_cpus, "num_gpus": config.sim.client_gpus}
    with kept_pythonpath():
        _run_simulation(
            num_supernodes=config.partition.num_clients,
            exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE,
            client_app=make_client_app(config),
            server_app=make_server_app(config),
            backend_config={"client_resources": resources, "init_args": {}},
        )


@contextlib.contextmanager
def kept_pythonpath() -> Iterator[None]:
    """``PYTHONPATH`` as it was before the block: Flower's Ray backend prepends this process's ``sys.path`` to it
    at every run's start, which would grow it by one copy a run here."""
    before = os.environ.get("PYTHONPATH")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def run_warm(config: Config) -> Path:
    """Run ``config`` here under its folder's lock and a watcher; returns the folder. Raises as
    ``fedguard.runtime.launcher.launch`` does: ``Interrupted``, ``LaunchError``, ``RunFolderBusy``."""
    folder = Path(config.run.out_dir)
    lock = hold(folder)
    try:
        with (
            tempfile.TemporaryDirectory(prefix="fedguard-") as home,
            watched(str(folder), lock, dict(os.environ), home),
        ):
            stop_file = Path(home) / "stop-request"
            os.environ[STOP_FILE_ENV] = str(stop_file)
            with SignalStop(stop_file) as stop:
                try:
                    simulate_here(config)
                except Exception:  # the run's status.json says how it ended; the traceback goes to its log
                    traceback.print_exc()
            signum = stop.signum
    finally:
        os.close(lock)
    return ending(folder, signum)


@contextlib.contextmanager
def output_to(log: Path) -> Iterator[None]:
    """This process's standard output and error (file descriptors 1 and 2, so Flower's and Ray's too) appended to
    ``log`` while the block runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "ab") as handle:
        os.dup2(handle.fileno(), 1)
        os.dup2(handle.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for descriptor in saved:
                os.close(descriptor)


def serve_one(request: dict[str, str]) -> int:
    """Check and run the configuration of the plan ``request["plan"]`` into ``request["out"]``, or resume the run in
    ``request["resume"]`` from its checkpoint, printing as ``fedguard run`` does; its exit code."""
    asked_at = time.time()

    def checked_and_run() -> Path:
        if "resume" in request:
            config, line = ready(resumed(Path(request["resume"])))
        else:
            config, line = ready(Config.from_plan(request["plan"]), Path(request["out"]))
        print(line, flush=True)
        return run_warm(config)

    # Any other error (a refused configuration, missing data, a failed run) is named in the log, exit code 1.
    return exit_code(checked_and_run, asked_at, failures=(Exception,))


class Requests:
    """The request lines on standard input, read by a thread of their own: standard input is also this process's
    lifeline (``fedguard.runtime.lifeline``). Its end while a run is served means the parent died (it closes it
    only between runs), and this process then ends at once (``lifeline.cut``: the run's watcher records it as
    interrupted and Ray ends the run's actors with their driver); between runs it ends the loop."""

    def __init__(self) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.serving, self.ended = threading.Event(), threading.Event()
        threading.Thread(target=self._read, name="fedguard-requests", daemon=True).start()

    def _read(self) -> None:
        for line in sys.stdin:
            if line.strip():
                self.lines.put(line)
        self.ended.set()
        if self.serving.is_set():
            lifeline.cut()
        self.lines.put(None)

    def next(self) -> dict[str, str] | None:
        """The next request, or None once standard input closed; the request is served until ``done``."""
        line = self.lines.get()
        self.serving.set()
        if line is None or self.ended.is_set():  # a request its parent did not live to see answered
            return None
        return dict(json.loads(line))

    def done(self) -> None:
        """The request is served (before its reply goes out: the parent may close the pipe once it has it)."""
        self.serving.clear()


def main() -> int:
    """Answer each request on standard input until it closes."""
    replies = os.dup(1)
    requests = Requests()
    while (request := requests.next()) is not None:
        with output_to(Path(request["log"])):
            code = serve_one(request)
        requests.done()
        os.write(replies, (json.dumps({"code": code}) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
