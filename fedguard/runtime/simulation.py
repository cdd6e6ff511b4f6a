"""``fedguard run``: the app on Flower's simulation runtime, launched the way Flower supports, ``flwr run``.

``prepare`` checks a configuration's ``sim.*`` and turns it into a ``fedguard.runtime.launcher.Launch``: the run
config ``flwr run`` passes (this repository's ``pyproject.toml`` is the app), the environment, and Flower's
federation settings (``num-supernodes``, ``client-resources-num-cpus/gpus``, ``init-args-num-cpus``) with which
the simulation engine starts Ray; with ``sim.address`` or ``RAY_ADDRESS`` it joins that Ray cluster instead.
``fedguard.runtime.launcher`` starts the processes, streams the logs and handles signals.

``sim.*`` that would leave the simulation waiting forever (clients reserving more CPUs or GPUs than there are,
a cluster address where nothing answers) are refused before anything starts.
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import socket
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

import tomli_w

from fedguard.config import Config, ConfigError, flatten
from fedguard.config_checks import ray_address_problem
from fedguard.run_plan import PLAN_KEY
from fedguard.runtime.app_bundle import stage_app
from fedguard.runtime.launcher import CONNECTION, STOP_FILE_ENV, Interrupted, Launch, LaunchError, launch
from fedguard.runtime.lifeline import LIFELINE_ENV
from fedguard.store.run_dir import unflatten

APP_DIR = Path(__file__).resolve().parents[2]
PROBE_SECONDS = 5.0  # how long a Ray cluster's address may take to answer

__all__ = ["CONNECTION", "Interrupted", "LaunchError", "prepare", "simulate"]


def app_config_keys(app_dir: Path = APP_DIR) -> dict[str, Any]:
    """The run-config keys the app declares (``[tool.flwr.app.config]``), flat, with their defaults."""
    pyproject = app_dir / "pyproject.toml"
    if not pyproject.is_file():
        raise LaunchError(
            f"{app_dir} holds no pyproject.toml: `fedguard run` needs the source checkout that "
            "`make install` installs from (the Flower app is that folder)"
        )
    return flatten(tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"])


def run_config(config: Config, declared: dict[str, Any]) -> dict[str, Any]:
    """The run config ``flwr run`` passes: the run plan (``fedguard.run_plan``), which the app's processes rebuild
    the configuration from, and, for a reader of ``run-config.toml``, every key the app declares that differs from
    its default; keys of plugins, which Flower would refuse as undeclared, packed into ``server.plugin-params``."""
    flat, defaults = config.to_flat(), Config().to_flat()
    undeclared = {k: v for k, v in flat.items() if k not in declared and v != defaults.get(k)}
    overrides = {k: v for k, v in flat.items() if k in declared and v != declared[k]}
    if undeclared:
        overrides["server.plugin-params"] = " ".join(shlex.quote(f"{k}={v}") for k, v in undeclared.items())
    overrides[PLAN_KEY] = config.plan()
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
    if problem := ray_address_problem(address, source):
        return problem
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_SECONDS).close()
    except OSError as error:
        return (
            f"{source} = {address!r}: no Ray cluster answers at {host}:{port} ({error.strerror or error}); "
            f"start one there (ray start --head --port={port}) or leave sim.address empty for a local one"
        )
    return None


def _visible_gpus() -> int:
    """The GPUs a local Ray cluster would find (CUDA devices visible to this process)."""
    import torch

    return torch.cuda.device_count()


def resource_problems(config: Config) -> list[str]:
    """What this machine lacks for ``config``: in ``sim.*``, what would leave the simulation waiting forever
    (clients that reserve more CPUs or GPUs than a local cluster has, a cluster to join, ``sim.address`` or
    ``RAY_ADDRESS``, that does not answer); an attack asked to run on CUDA in a local cluster without it."""
    address = joins_cluster(config)
    if address:
        source = "sim.address" if config.sim.address else "RAY_ADDRESS (environment)"
        return [problem] if (problem := _address_problem(address, source)) else []
    sim, problems = config.sim, _device_problems(config)
    if sim.client_cpus > sim.num_cpus:
        problems.append(
            f"sim.client-cpus = {sim.client_cpus}: each client would reserve more CPU cores than the "
            f"simulation's Ray cluster has (sim.num-cpus = {sim.num_cpus}; this machine has "
            f"{os.cpu_count()}); set it to at most {sim.num_cpus}"
        )
    gpus = _visible_gpus() if sim.client_gpus > 0 else 0
    if sim.client_gpus > gpus:
        hint = "" if gpus else " (0: clients train on CPUs)"
        problems.append(
            f"sim.client-gpus = {sim.client_gpus:g}: each client would reserve more GPUs than are "
            f"visible ({gpus}); set it to at most {gpus}{hint}"
        )
    return problems


def _device_problems(config: Config) -> list[str]:
    """Attacks whose ``device`` names CUDA where this machine has none (a local cluster's workers run here)."""
    import torch

    if torch.cuda.is_available():
        return []
    return [
        f"attack.{name}.device = {device!r}: CUDA is not available on this machine, where a local "
        f"simulation's attack workers run; set it to auto (CUDA when present) or cpu"
        for name, device in config.attack_devices().items()
        if device.startswith("cuda")
    ]


def ray_environment() -> dict[str, str]:
    """This process's environment as a local Ray cluster's processes get it from fedguard: this venv's programs
    first on ``PATH``, the working directory on ``PYTHONPATH`` (a plugin module there imports in the
    simulation's processes too), Ray on loopback only, no idle workers started ahead for the first driver (the
    clients' actors never use them: 0.1 GB), and accelerators left visible to workers that reserve none."""
    env = {
        **{name: value for name, value in os.environ.items() if name != LIFELINE_ENV},  # tied by its starter alone
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
        "RAY_prestart_worker_first_driver": "0",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
    }
    env.update(LOOPBACK_RAY)
    return env


def _environment(home: Path, config: Config) -> dict[str, str]:
    env = {
        **ray_environment(),
        "FLWR_HOME": str(home),
        STOP_FILE_ENV: str(home / "stop-request"),
        "FLWR_TELEMETRY_ENABLED": os.environ.get("FLWR_TELEMETRY_ENABLED", "0"),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
    }
    address = joins_cluster(config)
    if address:
        env["RAY_ADDRESS"] = address
    if address and not on_this_machine(address):
        for name in LOOPBACK_RAY:  # a cluster's nodes reach each other on its own addresses
            env.pop(name, None)
    # Otherwise a new cluster listens on loopback only. A cluster joined at a loopback address (or `auto`) has its
    # head here: without the switch Ray takes 127.0.0.1 for this machine's network address, where a head started
    # with the switch (as the venv's `activate` sets it) does not listen, and the run would wait forever; with it,
    # Ray uses the address as given, which reaches a head started either way.
    return env


def prepare(config: Config, verbose: bool = False) -> Launch:
    """The launch of ``config`` (whose ``out-dir`` is set) with ``partition.num-clients`` simulated SuperNodes:
    a temporary Flower home holding the run config, the app's files (``fedguard.runtime.app_bundle``: what
    ``flwr run`` builds its FAB from), the environment and the federation settings. Raises
    ``ConfigError`` for ``sim.*`` no simulation could run with."""
    problems = resource_problems(config)
    if problems:
        raise ConfigError(problems)
    overrides = run_config(config, app_config_keys())
    home = Path(tempfile.mkdtemp(prefix="fedguard-flwr-"))
    (home / "run-config.toml").write_text(tomli_w.dumps(unflatten(overrides)))
    return Launch(
        str(stage_app(APP_DIR, home / "app")),
        str(config.run.out_dir),
        str(home),
        _environment(home, config),
        federation_config(config),
        verbose,
        time.time(),
    )


def simulate(config: Config, verbose: bool = False) -> Path:
    """Run all rounds of ``config`` in this process (``prepare`` then ``fedguard.runtime.launcher.launch``); returns
    the run folder. Raises ``ConfigError``, ``Interrupted`` or ``LaunchError`` as those do."""
    return launch(prepare(config, verbose))
