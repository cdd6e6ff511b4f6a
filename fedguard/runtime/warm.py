"""A warm runtime: one Ray cluster and one runner process (``fedguard.runtime.warm_runner``) that run one run after
another, so that a run pays for neither's start.

    with WarmRuntime(cpus=2) as runtime:
        code = runtime.run(config, folder, log)      # the exit code `fedguard run preset --out folder` would have

Each run is still its own Flower run with its own folder, lock, watcher, seeds and report; what it computes
equals a ``fedguard run`` of the same configuration. ``fedguard sweep`` runs its runs in one
(``fedguard.commands.sweep.run_sweep``), and ``fedguard.run(..., warm=True)`` in one per Python process
(``fedguard.api``). A run past its time limit, or a Ctrl-C, reaches the runner as one SIGINT: the run
stops as ``fedguard run`` stops (results and report kept); a runner that does not answer ``STOP_WAIT`` seconds
later is killed (its watcher records the run as interrupted) and the next run starts a new one.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from fedguard import run_owner
from fedguard.runtime.launcher import LaunchError, is_flower_chatter
from fedguard.runtime.ray_head import RayHead
from fedguard.runtime.simulation import ray_environment

if TYPE_CHECKING:
    from fedguard.config import Config

STOP_WAIT = 90.0  # seconds a stopped run gets to record its attacks and write its report (it takes 60 at most)
POLL_SECONDS = 0.2
FLOWER_QUIET = {"FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1"}


class LogFollower:
    """The lines a run appends to its log (from byte ``start`` on), each passed on as it comes (Flower's own INFO
    lines only when ``verbose``)."""

    def __init__(self, log: Path, progress: Callable[[str], None], verbose: bool = False, start: int = 0) -> None:
        self.log, self.progress, self.verbose = log, progress, verbose
        self.offset, self.partial = start, ""  # start: the byte the lines to pass on begin at

    def poll(self) -> None:
        """Pass on the lines written since the last call."""
        try:
            with open(self.log, "rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except FileNotFoundError:
            return
        self.offset += len(chunk)
        *lines, self.partial = (self.partial + chunk.decode(errors="replace")).split("\n")
        for line in lines:
            if self.verbose or not is_flower_chatter(line):
                self.progress(line)


class WarmRuntime:
    """A Ray cluster of ``cpus`` CPUs (``fedguard.runtime.ray_head.RayHead``) and a runner joined to it, started on
    first use of ``run``; ``close`` (or the end of a ``with`` block) stops both. ``LaunchError`` when the cluster
    does not start."""

    def __init__(self, cpus: int, address: str | None = None) -> None:
        self.cpus = cpus
        self.head = None if address else RayHead(cpus)
        self.address = address or (self.head.address if self.head else None)
        if self.address is None:
            raise LaunchError(f"the warm runtime's Ray cluster ({cpus} CPUs) did not start")
        self.runner: subprocess.Popen[str] | None = None

    def __enter__(self) -> WarmRuntime:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def _started_runner(self) -> subprocess.Popen[str]:
        if self.runner is None or self.runner.poll() is not None:
            environment = {
                **ray_environment(),
                **FLOWER_QUIET,
                "FLWR_TELEMETRY_ENABLED": os.environ.get("FLWR_TELEMETRY_ENABLED", "0"),
                "RAY_ADDRESS": str(self.address),
                **run_owner.owner_entry(),  # no row of its runs is written once this process is gone
            }
            self.runner = subprocess.Popen(
                [sys.executable, "-m", "fedguard.runtime.warm_runner"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                bufsize=1,
                env=environment,
                start_new_session=True,  # a Ctrl-C reaches this process, which stops the run as asked
            )
        return self.runner

    def run(
        self,
        config: Config | None,
        out: Path,
        log: Path,
        timeout: float | None = None,
        progress: Callable[[str], None] | None = None,
        verbose: bool = False,
        resume: bool = False,
    ) -> int:
        """Run ``config`` (validated: the runner rebuilds it from its plan) into ``out``, or with ``resume`` go on
        with the stopped run in ``out`` from its checkpoint (``config`` unused), its output to ``log`` (appended when it
        resumes; each new line to ``progress``); its exit code as ``fedguard run``'s, -1 when it ran past
        ``timeout`` seconds. A Ctrl-C stops the run cleanly, then goes on up."""
        runner = self._started_runner()
        if not resume or not log.exists():
            log.write_bytes(b"")
        follower = LogFollower(log, progress, verbose, start=log.stat().st_size) if progress else None
        assert runner.stdin is not None
        request = {"log": str(log)}
        if resume:
            request["resume"] = str(Path(out).absolute())
        elif config is None:
            raise ValueError("WarmRuntime.run: give the configuration to run, or resume=True")
        else:
            request.update(plan=config.plan(), out=str(Path(out).absolute()))
        runner.stdin.write(json.dumps(request) + "\n")
        runner.stdin.flush()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                code = self._reply(POLL_SECONDS)
                if follower:
                    follower.poll()
                if code is not None:
                    return code
                if deadline is not None and time.monotonic() > deadline:
                    self._stop()
                    return -1
        except KeyboardInterrupt:
            self._stop()
            raise
        finally:
            if follower:
                follower.poll()

    def _reply(self, wait: float) -> int | None:
        """The runner's answer when one came within ``wait`` seconds, its exit code as negative signal number
        (or 1) when it died, else None."""
        assert self.runner is not None and self.runner.stdout is not None
        ready, _, _ = select.select([self.runner.stdout], [], [], wait)
        if not ready:
            return None
        line = self.runner.stdout.readline()
        if line:
            return int(json.loads(line)["code"])
        code = self.runner.wait()
        self.runner = None
        return code if code != 0 else 1

    def _stop(self) -> None:
        """Ask the runner's run to stop (one SIGINT: Ray's driver takes SIGTERM for itself) and wait ``STOP_WAIT``
        seconds for it to end; then kill the runner."""
        assert self.runner is not None
        self.runner.send_signal(signal.SIGINT)
        if self._reply(STOP_WAIT) is None and self.runner is not None:
            self.runner.kill()
            self.runner.wait()
            self.runner = None

    def close(self) -> None:
        """Stop the runner (it ends once its input closes) and the cluster."""
        if self.runner is not None:
            assert self.runner.stdin is not None
            self.runner.stdin.close()
            try:
                self.runner.wait(30)
            except subprocess.TimeoutExpired:
                self.runner.kill()
                self.runner.wait()
            self.runner = None
        if self.head is not None:
            self.head.stop()
