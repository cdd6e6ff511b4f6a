"""``fedguard run``: the app on Flower's simulation runtime, launched the way Flower supports, ``flwr run``.

A private SuperLink is started for the run, on loopback, in simulation mode, with runtime dependency
installation off and its state and Flower home in a temporary folder; the app (this repository's
``pyproject.toml``) is started on it with ``flwr run``, the run's logs are streamed here, and the SuperLink
is stopped at the end. The simulation engine starts Ray with ``sim.*`` (Flower's federation settings
``num-supernodes``, ``client-resources-num-cpus/gpus``, ``init-args-num-cpus``); with ``sim.address`` or
``RAY_ADDRESS`` it joins that Ray cluster instead.

The ServerApp writes ``status.json`` in the run folder (``fedguard.report.run_status``); the run's exit code
comes from it, since ``flwr run --stream`` ends the same way whether a run completed or failed.

``sim.*`` that would leave the simulation waiting forever (clients reserving more CPUs or GPUs than there are,
a cluster address where nothing answers) are refused before anything starts. The first SIGINT or SIGTERM asks
the run to stop (``fedguard.stopping``): the attacks still running are recorded as interrupted, the report is
written, and ``simulate`` raises ``Interrupted``; a second signal, or a run that has not ended
``STOP_GRACE`` seconds later, is stopped at once. Either way every process the run started is stopped
(``fedguard.processes``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path
from types import FrameType
from typing import IO, Any

import tomli_w

from fedguard.config import Config, ConfigError, flatten
from fedguard.processes import ProcessTracker
from fedguard.report.run_dir import unflatten
from fedguard.report.run_status import read_status
from fedguard.stopping import STOP_FILE_ENV

APP_DIR = Path(__file__).resolve().parents[1]
CONNECTION = "fedguard-local"


STOP_GRACE = 60.0  # seconds a stopped run gets to record its attacks and write its report
SETTLE_SECONDS = 10.0  # seconds the run's processes get to end on their own once it is over
PROBE_SECONDS = 5.0  # how long a Ray cluster's address may take to answer


class LaunchError(RuntimeError):
    """The private SuperLink or ``flwr run`` could not start, or the run did not complete."""


class Interrupted(RuntimeError):
    """``fedguard run`` was stopped by a signal; ``exit_code`` is 128 + its number, as a shell reports it."""

    def __init__(self, signum: int, folder: Path, status: dict[str, Any] | None) -> None:
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        if status is None:
            super().__init__(f"stopped by {name} before the run started")
        else:
            super().__init__(f"stopped by {name} after {status['rounds']} rounds; the results so far and the report "
                             f"are in {folder}")


def app_config_keys(app_dir: Path = APP_DIR) -> dict[str, Any]:
    """The run-config keys the app declares (``[tool.flwr.app.config]``), flat, with their defaults."""
    pyproject = app_dir / "pyproject.toml"
    if not pyproject.is_file():
        raise LaunchError(f"{app_dir} holds no pyproject.toml: `fedguard run` needs the source checkout that "
                          "`make install` installs from (the Flower app is that folder)")
    return flatten(tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"])


def run_config(config: Config, declared: dict[str, Any]) -> dict[str, Any]:
    """The run config ``flwr run`` passes: every key the app declares that differs from its default; keys of
    plugins, which Flower would refuse as undeclared, packed into ``server.plugin-params``."""
    flat, defaults = config.to_flat(), Config().to_flat()
    undeclared = {k: v for k, v in flat.items() if k not in declared and v != defaults.get(k)}
    overrides = {k: v for k, v in flat.items() if k in declared and v != declared[k]}
    if undeclared:
        overrides["server.plugin-params"] = " ".join(shlex.quote(f"{k}={v}") for k, v in undeclared.items())
    return overrides


# Ray's switch for single-machine clusters: its processes listen on 127.0.0.1 instead of every interface.
LOOPBACK_RAY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def joins_cluster(config: Config) -> str | None:
    """The Ray cluster the simulation joins (``sim.address``, else ``RAY_ADDRESS``), or None for a new one."""
    return config.sim.address or os.environ.get("RAY_ADDRESS") or None


def on_this_machine(address: str) -> bool:
    """Whether a Ray cluster address names this machine's own Ray: ``auto`` (the cluster running here) or a
    loopback host (``127.0.0.1:6379``, ``localhost:6379``, ``[::1]:6379``, ``ray://`` too)."""
    if address == "auto":
        return True
    host = address.removeprefix("ray://").rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def federation_config(config: Config) -> str:
    """``--federation-config`` of ``flwr run``: one SuperNode per client, the ``sim.*`` resources."""
    items: dict[str, Any] = {
        "num-supernodes": config.partition.num_clients,
        "client-resources-num-cpus": config.sim.client_cpus,
        "client-resources-num-gpus": config.sim.client_gpus,
    }
    if joins_cluster(config) is None:  # an existing cluster brings its own CPUs; Ray refuses num_cpus then
        items["init-args-num-cpus"] = config.sim.num_cpus
    return " ".join(f"{k}={v}" for k, v in items.items())


def _address_problem(address: str, source: str) -> str | None:
    """Why nothing would run on the Ray cluster at ``address`` (named ``source`` in messages), or None: the
    address must read ``auto``, ``host:port`` or ``ray://host:port``, and something must answer there."""
    if address == "auto":
        return None
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not (sep and host and port.isdigit()):
        return f"{source} = {address!r}: not a Ray cluster address; write host:port, ray://host:port or auto"
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_SECONDS).close()
    except OSError as error:
        return (f"{source} = {address!r}: no Ray cluster answers at {host}:{port} ({error.strerror or error}); "
                f"start one there (ray start --head --port={port}) or leave sim.address empty for a local one")
    return None


def _visible_gpus() -> int:
    """The GPUs a local Ray cluster would find (CUDA devices visible to this process)."""
    import torch

    return torch.cuda.device_count()


def resource_problems(config: Config) -> list[str]:
    """What in ``sim.*`` would leave the simulation waiting forever: clients that reserve more CPUs or GPUs than
    a local cluster has, or a cluster to join (``sim.address``, ``RAY_ADDRESS``) that does not answer."""
    address = joins_cluster(config)
    if address:
        source = "sim.address" if config.sim.address else "RAY_ADDRESS (environment)"
        return [problem] if (problem := _address_problem(address, source)) else []
    sim, problems = config.sim, []
    if sim.client_cpus > sim.num_cpus:
        problems.append(f"sim.client-cpus = {sim.client_cpus}: each client would reserve more CPU cores than the "
                        f"simulation's Ray cluster has (sim.num-cpus = {sim.num_cpus}; this machine has "
                        f"{os.cpu_count()}); set it to at most {sim.num_cpus}")
    gpus = _visible_gpus() if sim.client_gpus > 0 else 0
    if sim.client_gpus > gpus:
        hint = "" if gpus else " (0: clients train on CPUs)"
        problems.append(f"sim.client-gpus = {sim.client_gpus:g}: each client would reserve more GPUs than are "
                        f"visible ({gpus}); set it to at most {gpus}{hint}")
    return problems


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, process: subprocess.Popen, timeout: float, log_file: Path, stop: SignalStop) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and stop.signum is None:
        if process.poll() is not None:
            raise LaunchError(f"the private SuperLink exited with code {process.returncode}:\n"
                              f"{log_file.read_text()[-2000:]}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    if stop.signum is None:
        raise LaunchError(f"the private SuperLink did not listen on 127.0.0.1:{port} within {timeout:.0f} s; "
                          f"its log: {log_file}")


def _environment(home: Path, config: Config) -> dict[str, str]:
    env = {**os.environ, "FLWR_HOME": str(home), "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
           STOP_FILE_ENV: str(home / "stop-request"),
           "FLWR_TELEMETRY_ENABLED": os.environ.get("FLWR_TELEMETRY_ENABLED", "0"),
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    # A plugin module in the working directory (server.plugins) imports in the simulation's processes too.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    address = joins_cluster(config)
    if address:
        env["RAY_ADDRESS"] = address
    if address and not on_this_machine(address):
        for name in LOOPBACK_RAY:  # a cluster's nodes reach each other on its own addresses
            env.pop(name, None)
    else:
        # A new cluster listens on loopback only. A cluster joined at a loopback address (or `auto`) has its
        # head here: without the switch Ray takes 127.0.0.1 for this machine's network address, where a head
        # started with the switch (as the venv's `activate` sets it) does not listen, and the run would wait
        # forever; with it, Ray uses the address as given, which reaches a head started either way.
        env.update(LOOPBACK_RAY)
    return env


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
                self.stop_file.write_text(name)
            _say(f"{name}: stopping the run: the attacks still running are recorded as interrupted and the "
                 "report is written (send the signal again to stop at once)")
        elif len(self.signals) == 2:
            _say(f"{name} again: stopping at once")


def _say(message: str) -> None:
    """Write a line to stderr without Python's buffers (safe from a signal handler)."""
    os.write(sys.stderr.fileno(), f"\nfedguard: {message}\n".encode())


def simulate(config: Config, verbose: bool = False) -> Path:
    """Run all rounds of ``config`` (whose ``out-dir`` is set) with ``partition.num-clients`` simulated
    SuperNodes; returns the run folder. Raises ``ConfigError`` for ``sim.*`` no simulation could run with,
    ``Interrupted`` when a signal stopped it, ``LaunchError`` when the run did not complete."""
    problems = resource_problems(config)
    if problems:
        raise ConfigError(problems)
    folder = Path(config.run.out_dir)
    declared = app_config_keys()
    overrides = run_config(config, declared)
    home = Path(tempfile.mkdtemp(prefix="fedguard-flwr-"))
    port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    (home / "run-config.toml").write_text(tomli_w.dumps(unflatten(overrides)))
    env = _environment(home, config)
    log_file = home / "superlink.log"
    command = ["flower-superlink", "--insecure", "--simulation", "--disable-runtime-dependency-installation",
               "--host", "127.0.0.1", "--port", str(port), "--database", str(home / "state.db")]
    tracker = ProcessTracker()
    try:
        with SignalStop(Path(env[STOP_FILE_ENV])) as stop:
            with open(log_file, "w") as log:
                superlink = subprocess.Popen(command, env=env, cwd=home, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)
            tracker.watch(superlink.pid)
            try:
                _wait_for_port(port, superlink, 60, log_file, stop)
                if stop.signum is None:
                    run = ["flwr", "run", str(APP_DIR), CONNECTION, "--federation-config",
                           federation_config(config), "--run-config", str(home / "run-config.toml"), "--stream"]
                    _stream(run, env, home, verbose, stop, tracker)
            finally:
                _shut_down(superlink, tracker, stop)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    return _ending(folder, stop.signum)


def _ending(folder: Path, signum: int | None) -> Path:
    """``folder`` when its run completed; ``Interrupted`` when ``signum`` stopped it; else ``LaunchError``."""
    status = read_status(folder)
    if signum is not None:
        raise Interrupted(signum, folder, status)
    if status is None:
        raise LaunchError(f"the run stopped before its ServerApp started or wrote {folder}/status.json")
    if status["status"] != "completed":
        raise LaunchError(f"the run ended as {status['status']!r}: {status.get('error', '')}")
    return folder


def _stream(command: list[str], env: dict[str, str], cwd: Path, verbose: bool, stop: SignalStop,
            tracker: ProcessTracker) -> None:
    """Run ``command`` (in its own session: signals reach it through the stop request only), printing its
    output (Flower's own INFO lines only when ``verbose``) and noting the processes the run starts, until it
    ends or ``stop`` is hurried."""
    process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, bufsize=1, start_new_session=True)
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
        if verbose or not _is_flower_chatter(line):
            print(line, end="", flush=True)


def _is_flower_chatter(line: str) -> bool:
    """Flower's INFO log lines (round banners, sampling), shown with ``--verbose`` only."""
    return line.lstrip().startswith(("INFO :", "\x1b[92mINFO", "DEBUG :")) or not line.strip()


def _shut_down(superlink: subprocess.Popen, tracker: ProcessTracker, stop: SignalStop) -> None:
    """Stop the SuperLink, then every process the run started that is still running: given ``SETTLE_SECONDS``
    to end on their own (none when ``stop`` is hurried), then terminated."""
    tracker.update()
    _stop(superlink, grace=5.0 if stop.hurried() else 20.0)
    left = tracker.stop(patience=0.0 if stop.hurried() else SETTLE_SECONDS)
    if left:
        _say(f"processes of the run still running after SIGKILL: {sorted(p.pid for p in left)}")


def _stop(process: subprocess.Popen, grace: float = 20.0) -> None:
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
