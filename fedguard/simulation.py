"""Run the app on Flower's simulation engine: every client a Ray actor on this machine."""

from __future__ import annotations

import logging
import os
import sys

from fedguard.config import Config


class _DropDeprecation(logging.Filter):
    """Hide Flower's notice that ``run_simulation`` is deprecated: this launcher is the supported path."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "run_simulation` function is deprecated" not in record.getMessage()


def backend_config(config: Config) -> dict:
    """What each simulated client reserves; the cluster itself is started by ``start_ray``."""
    return {"client_resources": {"num_cpus": config.sim.client_cpus, "num_gpus": config.sim.client_gpus}}


def start_ray(config: Config) -> None:
    """Start the local Ray cluster the clients and the attacker workers share.

    Attacker workers claim the custom resource ``attacker`` (one each) and no
    CPU, so that Flower's client actors, which size themselves by CPUs, never
    starve them. Workers see this process's ``sys.path``, as Flower arranges it.
    With ``sim.address`` it joins that cluster instead (start each machine with
    ``ray start ... --resources '{"attacker": 1}'`` to give it attacker slots).
    """
    import ray

    from attackers.pool import ATTACKER_RESOURCE

    if ray.is_initialized():
        return
    pythonpath = os.pathsep.join([*sys.path, *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ["PYTHONPATH"] = pythonpath
    if config.sim.address:  # an existing cluster: its machines bring their own CPUs, GPUs and attacker slots
        ray.init(address=config.sim.address, runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
                 logging_level=logging.WARNING)
        return
    ray.init(
        num_cpus=config.sim.num_cpus,
        object_store_memory=512 * 1024 * 1024,
        include_dashboard=False,
        resources={ATTACKER_RESOURCE: config.pool.workers},
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
        logging_level=logging.WARNING,
    )


def simulate(config: Config, verbose: bool = False) -> None:
    """Run all rounds of ``config`` with ``partition.num-clients`` simulated SuperNodes."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    from flwr.simulation import run_simulation

    from fedguard.client_app import make_client_app
    from fedguard.server_app import make_server_app

    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addFilter(_DropDeprecation())
    for handler in flwr_logger.handlers:
        handler.addFilter(_DropDeprecation())
    if not verbose:
        flwr_logger.setLevel(logging.WARNING)
    import ray

    start_ray(config)
    try:
        run_simulation(
            server_app=make_server_app(config),
            client_app=make_client_app(config),
            num_supernodes=config.partition.num_clients,
            backend_config=backend_config(config),
            verbose_logging=verbose,
        )
    finally:
        ray.shutdown()
