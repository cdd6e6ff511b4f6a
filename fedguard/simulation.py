"""``fedguard run``: the app on Flower's simulation runtime, launched the way Flower supports, ``flwr run``.

A private SuperLink is started for the run, on loopback, in simulation mode, with runtime dependency
installation off and its state and Flower home in a temporary folder; the app (this repository's
``pyproject.toml``) is started on it with ``flwr run``, the run's logs are streamed here, and the SuperLink
is stopped at the end. The simulation engine starts Ray with ``sim.*`` (Flower's federation settings
``num-supernodes``, ``client-resources-num-cpus/gpus``, ``init-args-num-cpus``); with ``sim.address`` or
``RAY_ADDRESS`` it joins that Ray cluster instead.

The ServerApp writes ``status.json`` in the run folder (``fedguard.report.run_status``); the run's exit code
comes from it, since ``flwr run --stream`` ends the same way whether a run completed or failed.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from fedguard.config import Config, flatten
from fedguard.report.run_dir import unflatten
from fedguard.report.run_status import read_status

APP_DIR = Path(__file__).resolve().parents[1]
CONNECTION = "fedguard-local"


class LaunchError(RuntimeError):
    """The private SuperLink or ``flwr run`` could not start, or the run did not complete."""


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, process: subprocess.Popen, timeout: float, log_file: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LaunchError(f"the private SuperLink exited with code {process.returncode}:\n"
                              f"{log_file.read_text()[-2000:]}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise LaunchError(f"the private SuperLink did not listen on 127.0.0.1:{port} within {timeout:.0f} s; "
                      f"its log: {log_file}")


def _environment(home: Path, config: Config) -> dict[str, str]:
    env = {**os.environ, "FLWR_HOME": str(home), "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
           "FLWR_TELEMETRY_ENABLED": os.environ.get("FLWR_TELEMETRY_ENABLED", "0"),
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    # A plugin module in the working directory (server.plugins) imports in the simulation's processes too.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    address = joins_cluster(config)
    if address:
        env["RAY_ADDRESS"] = address
        for name in LOOPBACK_RAY:  # a cluster's nodes reach each other on its own addresses
            env.pop(name, None)
    else:
        env.update(LOOPBACK_RAY)
    return env


def simulate(config: Config, verbose: bool = False) -> Path:
    """Run all rounds of ``config`` (whose ``out-dir`` is set) with ``partition.num-clients`` simulated
    SuperNodes; returns the run folder. Raises ``LaunchError`` when the run did not complete."""
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
    with open(log_file, "w") as log:
        superlink = subprocess.Popen(command, env=env, cwd=home, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
    try:
        _wait_for_port(port, superlink, 60, log_file)
        run = ["flwr", "run", str(APP_DIR), CONNECTION, "--federation-config", federation_config(config),
               "--run-config", str(home / "run-config.toml"), "--stream"]
        _stream(run, env, home, verbose)
    finally:
        _stop(superlink)
        shutil.rmtree(home, ignore_errors=True)
    status = read_status(folder)
    if status is None:
        raise LaunchError(f"the run stopped before its ServerApp started or wrote {folder}/status.json")
    if status["status"] != "completed":
        raise LaunchError(f"the run {status['status']}: {status.get('error', '')}")
    return folder


def _stream(command: list[str], env: dict[str, str], cwd: Path, verbose: bool) -> None:
    """Run ``command``, printing its output; Flower's own INFO lines only when ``verbose``."""
    with subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, bufsize=1) as process:
        assert process.stdout is not None
        for line in process.stdout:
            if verbose or not _is_flower_chatter(line):
                print(line, end="", flush=True)
    if process.returncode != 0:
        raise LaunchError(f"`{' '.join(command[:3])} ...` exited with code {process.returncode}")


def _is_flower_chatter(line: str) -> bool:
    """Flower's INFO log lines (round banners, sampling), shown with ``--verbose`` only."""
    return line.lstrip().startswith(("INFO :", "\x1b[92mINFO", "DEBUG :")) or not line.strip()


def _stop(process: subprocess.Popen) -> None:
    """Stop the SuperLink and everything it started (its process group)."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
