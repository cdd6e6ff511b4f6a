"""The attacker pool: the attack runner (``attackers.runner``) on Ray actors, beside a live run's clients.

The pool is an ``ObservationSink``: ``submit`` queues one task per attack that applies to the observation and
returns at once, so aggregation never waits; the runner's scheduling, batching, retries, time limits and closing
are ``attackers.runner.AttackRunner``'s. Here: the workers (``RayWorkers``). A worker past its time limit, or
whose process died, is killed and started again.

Workers take one GPU each when CUDA is visible and the attack's device is not
'cpu' and Ray has a whole GPU free; when the simulated clients hold every GPU share
(``sim.client-gpus``), they use the device beside them without a Ray claim (``gpu_options``).
Otherwise they take CPU threads. Inside a Flower simulation the pool
uses the simulation's Ray cluster; elsewhere it starts a local one, or joins
the cluster at ``address``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import ray
import torch

from attackers.base import AttackOutcome
from attackers.runner import AttackFactory, AttackRunner, AttackSpec, AttackWorker, Finished
from fedguard.app_code import Call
from fedguard.observation import Observation

log = logging.getLogger(__name__)

ATTACKER_RESOURCE = "attacker"
# Ray hides every GPU from an actor that claims none (CUDA_VISIBLE_DEVICES="") unless this is "0" in its process.
OVERRIDE_ON_ZERO = "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"


def gpu_options(free_gpus: float) -> dict[str, Any]:
    """Ray actor options for an attack worker on the GPU, given the GPUs Ray has free (a count, may be
    fractional): a whole GPU when one is free; else no claim and the devices left visible, so that the
    worker shares the GPU the client actors reserved (Flower sizes its actor pool to take all of it)."""
    if free_gpus >= 1:
        return {"num_gpus": 1}
    return {"num_gpus": 0, "runtime_env": {"env_vars": {OVERRIDE_ON_ZERO: "0"}}}


def _worker_actor() -> type:
    """The actor class of a worker. It is local, so Ray ships it by value and the worker imports nothing of this
    app for it; the ``AttackWorker`` it builds comes as a ``Call``, unpickled from this app's code
    (``fedguard.app_code``), not from a copy in the folder Ray's driver was started in."""

    class AttackWorkerActor:
        def __init__(self, make: Callable[[], Any]) -> None:
            self.worker = make()

        def run(self, attack: str, observations: list[Any], seed: int) -> list[Any]:
            return self.worker.run(attack, observations, seed)

    return AttackWorkerActor


AttackWorkerActor: Any = ray.remote(_worker_actor())


class RayWorkers:
    """Ray actors as the runner's workers (``attackers.runner.Workers``): ``workers`` of them, each with
    ``threads`` torch threads, on the GPU when ``use_gpu`` (see ``gpu_options``); joining the cluster at
    ``address`` when Ray is not running yet (None: a local one)."""

    def __init__(self, workers: int = 1, threads: int = 1, use_gpu: bool = False, address: str | None = None) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.num_workers = workers
        self.threads = threads
        self.use_gpu = use_gpu and torch.cuda.is_available()
        self.address = address
        self.workers: list[Any] = []
        self._factories: dict[str, AttackFactory] = {}
        self._has_resource = False
        self._gpu_options: dict[str, Any] = {}
        self._ready: list[bool] = []
        self._ready_refs: dict[Any, int] = {}

    def starts_early(self) -> bool:
        """Only inside a running Ray (a simulation's engine started it) and off the GPU: on a GPU the workers
        start at the first submit, once the simulated clients took their share of it."""
        return not self.use_gpu and ray.is_initialized()

    def start(self, factories: dict[str, AttackFactory]) -> None:
        """Join (or start) Ray and create the workers. Runs on the runner's thread, so that inside a simulation
        the engine has started Ray by then and the pool never races it."""
        if not ray.is_initialized():
            resources: dict[str, float] | None = None if self.address else {ATTACKER_RESOURCE: self.num_workers}
            ray.init(address=self.address, include_dashboard=False, resources=resources)
        self._factories = factories
        self._has_resource = ray.cluster_resources().get(ATTACKER_RESOURCE, 0) >= 1
        self._gpu_options = gpu_options(ray.available_resources().get("GPU", 0.0)) if self.use_gpu else {}
        if self._gpu_options.get("num_gpus") == 0:
            log.warning(
                "the attack workers share the GPU with the simulated clients: Ray has no whole GPU free "
                "(sim.client-gpus reserved it), so they run on it without a Ray claim"
            )
        self.workers = [None] * self.num_workers
        self._ready = [False] * self.num_workers
        for index in range(self.num_workers):
            self._launch(index)

    def _launch(self, index: int) -> None:
        """(Re)start worker ``index``; it gets work only once it is up, so start-up never counts against the
        time limit."""
        # No CPU claim: Flower sizes its client actors by CPUs, and a claim could leave a worker unscheduled.
        options: dict[str, Any] = {"num_cpus": 0}
        if self._has_resource:
            options["resources"] = {ATTACKER_RESOURCE: 1}
        options.update(self._gpu_options)
        self.workers[index] = AttackWorkerActor.options(**options).remote(
            Call(AttackWorker, self._factories, self.threads)
        )
        self._ready[index] = False
        self._ready_refs[self.workers[index].__ray_ready__.remote()] = index

    def idle(self, busy: set[int]) -> list[int]:
        if self._ready_refs:
            done, _ = ray.wait(list(self._ready_refs), num_returns=len(self._ready_refs), timeout=0)
            for ref in done:
                self._ready[self._ready_refs.pop(ref)] = True
        return [i for i in range(len(self.workers)) if self._ready[i] and i not in busy]

    def send(self, worker: int, attack: str, observations: list[Observation], seed: int) -> Any:
        return self.workers[worker].run.remote(attack, observations, seed)

    def finished(self, handles: list[Any]) -> list[Any]:
        return ray.wait(handles, num_returns=len(handles), timeout=0)[0] if handles else []

    def result(self, handle: Any) -> Finished:
        try:
            return Finished(ray.get(handle))
        except Exception as error:  # a worker's exception arrives wrapped by Ray
            lost = isinstance(error, ray.exceptions.RayActorError)
            return Finished(None, f"{type(error).__name__}: {error}", lost=lost)

    def replace(self, worker: int) -> None:
        ray.kill(self.workers[worker], no_restart=True)
        self._launch(worker)

    def stop(self) -> None:
        """Kill every worker; one that cannot be reached (Ray already gone) is left to Ray's own ending."""
        for worker in self.workers:
            if worker is None:
                continue
            try:
                ray.kill(worker, no_restart=True)
            except Exception as error:
                log.warning("attacker worker not stopped: %s: %s", type(error).__name__, error)


class AttackPool(AttackRunner):
    """The attack runner on ``RayWorkers``; see the module docstring and ``attackers.runner.AttackRunner``.

    ``workers``, ``threads``, ``use_gpu``, ``address``: the workers' (``RayWorkers``); the rest: the runner's.
    """

    def __init__(
        self,
        attacks: list[AttackSpec],
        on_outcome: Callable[[AttackOutcome], None],
        workers: int = 1,
        time_limit: float = 600.0,
        group: int = 4,
        threads: int = 1,
        use_gpu: bool = False,
        address: str | None = None,
        poll_seconds: float = 0.2,
        seed: int = 0,
        stop: Callable[[], str | None] = lambda: None,
    ) -> None:
        backend = RayWorkers(workers, threads, use_gpu, address)
        super().__init__(attacks, on_outcome, backend, time_limit, group, seed, stop, poll_seconds)
        self.ray_workers = backend
