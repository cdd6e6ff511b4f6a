"""One local Ray cluster for the runs of a sweep: each run's simulation joins it instead of starting its own.

A run that starts Ray pays for it twice, at ``ray.init`` and at its shutdown (about 6 s on 2 cores). ``shared_ray``
starts the cluster once, in a helper process (``python -m fedguard.runtime.ray_head NUM_CPUS``) that calls
``ray.init`` as a simulation would (the same CPU count, no dashboard, the same environment), prints the cluster's
address, and stops Ray when its standard input closes: when the sweep ends, or when the sweep's process dies,
since nobody else holds that pipe. The cluster's own processes share the helper's fate (Ray ties them to the
process that started them). Each run is still its own Flower run, with its own SuperLink, folder, lock and seeds:
it joins the cluster through ``RAY_ADDRESS``, as ``fedguard run`` joins any cluster
(``fedguard.runtime.simulation.joins_cluster``), and its Ray job ends with it, actors and attack workers
included. Runs share one only where they would have started the same cluster: none of them names a cluster of
its own to join or asks for what this machine lacks, and all ask for the same ``sim.num-cpus``.
"""

from __future__ import annotations

import contextlib
import logging
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence

from fedguard.config import Config
from fedguard.runtime.simulation import joins_cluster, ray_environment, resource_problems

START_SECONDS = 60.0  # how long the helper may take to print the cluster's address


def shared_cpus(configs: Sequence[Config]) -> int | None:
    """The ``sim.num-cpus`` of a cluster all of ``configs`` would start alike, or None: one of them joins a cluster
    (``sim.address``, ``RAY_ADDRESS``), asks for what this machine lacks (``resource_problems``: checked here, where
    the run would check it against a cluster of its own), or they ask for different CPU counts."""
    distinct = {repr((config.sim, config.attack_devices())): config for config in configs}  # what is checked
    if not configs or any(joins_cluster(config) or resource_problems(config) for config in distinct.values()):
        return None
    counts = {config.sim.num_cpus for config in configs}
    return counts.pop() if len(counts) == 1 else None


def _address(helper: subprocess.Popen[str]) -> str | None:
    """The address line the helper prints, or None when it exits or stays silent for ``START_SECONDS``."""
    assert helper.stdout is not None
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        ready, _, _ = select.select([helper.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = helper.stdout.readline()
        if not line:
            return None
        if line.startswith("address "):
            return line.split(maxsplit=1)[1].strip()
    return None


class RayHead:
    """A local Ray cluster of ``cpus`` CPUs in a helper process; ``address`` is None when it did not start."""

    def __init__(self, cpus: int) -> None:
        self.cpus = cpus
        self.helper = subprocess.Popen(
            [sys.executable, "-m", "fedguard.runtime.ray_head", str(cpus)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=ray_environment(),
            start_new_session=True,  # a Ctrl-C reaches the sweep, which stops the runs first, then closes the pipe
        )
        self.address = _address(self.helper)

    def stop(self) -> None:
        """Stop the cluster (idempotent)."""
        _stop(self.helper)


@contextlib.contextmanager
def shared_ray(configs: Sequence[Config], say: Callable[[str], None] = print) -> Iterator[dict[str, str]]:
    """Start one Ray cluster for the runs of ``configs`` (``shared_cpus``); yields the environment a run's process
    joins it with (``RAY_ADDRESS``), empty where the runs cannot share one or it did not start (they then start
    their own, as alone). The cluster stops when the block ends."""
    cpus = shared_cpus(configs)
    if cpus is None:
        yield {}
        return
    head = RayHead(cpus)
    try:
        if head.address is None:
            say("fedguard: the sweep's shared Ray cluster did not start; each run starts its own")
            yield {}
        else:
            yield {"RAY_ADDRESS": head.address}
    finally:
        head.stop()


def _stop(helper: subprocess.Popen[str]) -> None:
    """Close the helper's pipe (it stops Ray and exits); kill it after ``START_SECONDS``."""
    if helper.poll() is not None and helper.stdout is not None and helper.stdout.closed:
        return
    with contextlib.suppress(OSError):
        assert helper.stdin is not None
        helper.stdin.close()
    try:
        helper.wait(START_SECONDS)
    except subprocess.TimeoutExpired:
        helper.kill()
        helper.wait()
    if helper.stdout is not None:
        helper.stdout.close()


def main(argv: list[str]) -> int:
    """``python -m fedguard.runtime.ray_head NUM_CPUS``: start Ray, print ``address HOST:PORT``, stop Ray once
    standard input closes."""
    import ray

    ray.init(num_cpus=int(argv[0]), include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    print(f"address {ray.get_runtime_context().gcs_address}", flush=True)
    while sys.stdin.read(4096):
        pass
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
