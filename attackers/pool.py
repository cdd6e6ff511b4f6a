"""The attacker pool: Ray actors that run an attack on captured observations.

The pool is an ``ObservationSink``: ``submit`` queues and returns at once, so
aggregation never waits. A background thread hands queued observations to
idle workers (up to ``group`` of one shape at a time, which the attack runs as
one batch), collects results as they arrive and passes every outcome, good or
bad, to ``on_outcome``. A worker that raises yields an 'error' outcome; one
that runs past its time limit is killed, replaced, and yields a 'timeout'
outcome. ``close`` waits for what is left up to a limit and reports the rest
as 'timeout'.

Workers take one GPU each when CUDA is visible and the attack's device is not
'cpu'; otherwise they take CPU threads. Inside a Flower simulation the pool
uses the simulation's Ray cluster; elsewhere it starts a local one, or joins
the cluster at ``address``.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import ray
import torch

from attackers.base import AttackOutcome, Reconstruction, shape_key
from fedguard.observation import Observation

log = logging.getLogger(__name__)

ATTACKER_RESOURCE = "attacker"

AttackFactory = Callable[[], Any]


@ray.remote
class AttackWorker:
    """One attacker process: builds the attack once, then reconstructs what it is given."""

    def __init__(self, factory: AttackFactory, threads: int) -> None:
        torch.set_num_threads(max(1, threads))
        self.attack = factory()

    def run(self, observations: list[Observation]) -> list[Reconstruction]:
        if hasattr(self.attack, "reconstruct_many") and len(observations) > 1:
            return self.attack.reconstruct_many(observations)
        return [self.attack.reconstruct(obs) for obs in observations]


@dataclass
class _Dispatch:
    worker: int
    observations: list[Observation]
    started: float
    limit: float


@dataclass
class PoolStats:
    """Counts of outcomes so far."""

    submitted: int = 0
    ok: int = 0
    error: int = 0
    timeout: int = 0
    restarts: int = 0
    outcomes: list[AttackOutcome] = field(default_factory=list)


class AttackPool:
    """Ray attacker workers fed without blocking; see the module docstring.

    Parameters
    ----------
    factory : Callable[[], Attack]
        Builds the attack inside each worker (must be picklable).
    on_outcome : Callable[[AttackOutcome], None]
        Called, on the pool's thread, once for every submitted observation.
    workers : int
        Number of worker actors (>= 1).
    time_limit : float
        Seconds one observation may take; a group of k gets k times as long.
    group : int
        Most observations of one shape given to a worker at once.
    threads : int
        Torch threads of each CPU worker.
    use_gpu : bool
        One GPU per worker (only when CUDA is visible).
    address : str | None
        Address of an existing Ray cluster to join when Ray is not running yet.
    """

    def __init__(
        self,
        factory: AttackFactory,
        on_outcome: Callable[[AttackOutcome], None],
        workers: int = 1,
        time_limit: float = 600.0,
        group: int = 4,
        threads: int = 1,
        use_gpu: bool = False,
        address: str | None = None,
        poll_seconds: float = 0.2,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not time_limit > 0:
            raise ValueError(f"time_limit must be > 0, got {time_limit}")
        if group < 1:
            raise ValueError(f"group must be >= 1, got {group}")
        self.factory = factory
        self.on_outcome = on_outcome
        self.time_limit = time_limit
        self.group = group
        self.threads = threads
        self.use_gpu = use_gpu and torch.cuda.is_available()
        self.stats = PoolStats()
        self.num_workers = workers
        self.address = address
        self._has_resource = False
        self._start_error: str | None = None
        self._workers: list[Any] = []
        self._ready: list[bool] = []
        self._ready_refs: dict[Any, int] = {}
        self._started = False
        self._busy: dict[ray.ObjectRef, _Dispatch] = {}
        self._queue: deque[Observation] = deque()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._poll_seconds = poll_seconds
        self._thread = threading.Thread(target=self._loop, name="attack-pool", daemon=True)

    def _start(self) -> None:
        """Join (or start) Ray and create the workers. Runs on the pool's thread at the first submit, so
        that inside a simulation the engine has started Ray by then and the pool never races it."""
        if not ray.is_initialized():
            resources = None if self.address else {ATTACKER_RESOURCE: self.num_workers}
            ray.init(address=self.address, include_dashboard=False, resources=resources)
        self._has_resource = ray.cluster_resources().get(ATTACKER_RESOURCE, 0) >= 1
        self._workers = [None] * self.num_workers
        self._ready = [False] * self.num_workers
        for index in range(self.num_workers):
            self._launch(index)

    def _launch(self, index: int) -> None:
        """(Re)start worker ``index``; it gets work only once it is up, so start-up never counts
        against the time limit."""
        self._workers[index] = self._start_worker()
        self._ready[index] = False
        self._ready_refs[self._workers[index].__ray_ready__.remote()] = index

    def _start_worker(self) -> Any:
        # No CPU claim: Flower sizes its client actors by CPUs, and a claim could leave a worker unscheduled.
        options: dict[str, Any] = {"num_cpus": 0}
        if self._has_resource:
            options["resources"] = {ATTACKER_RESOURCE: 1}
        if self.use_gpu:
            options["num_gpus"] = 1
        return AttackWorker.options(**options).remote(self.factory, self.threads)

    def submit(self, obs: Observation) -> None:
        """Queue ``obs`` for attack; returns immediately. Raises ``RuntimeError`` after ``close``."""
        with self._lock:
            if self._closing.is_set():
                raise RuntimeError("the attack pool is closed; no more observations are taken")
            self._queue.append(obs)
            self.stats.submitted += 1
            if not self._started:
                self._started = True
                self._thread.start()

    def pending(self) -> int:
        """Observations queued or running."""
        with self._lock:
            return len(self._queue) + sum(len(d.observations) for d in self._busy.values())

    def _idle_workers(self) -> list[int]:
        if self._ready_refs:
            done, _ = ray.wait(list(self._ready_refs), num_returns=len(self._ready_refs), timeout=0)
            for ref in done:
                self._ready[self._ready_refs.pop(ref)] = True
        busy = {d.worker for d in self._busy.values()}
        return [i for i in range(len(self._workers)) if self._ready[i] and i not in busy]

    def _dispatch(self) -> None:
        with self._lock:
            for worker in self._idle_workers():
                if not self._queue:
                    return
                first = self._queue.popleft()
                group = [first]
                for obs in list(self._queue):
                    if len(group) >= self.group:
                        break
                    if shape_key(obs) == shape_key(first):
                        group.append(obs)
                        self._queue.remove(obs)
                ref = self._workers[worker].run.remote(group)
                self._busy[ref] = _Dispatch(worker, group, time.monotonic(), self.time_limit * len(group))

    def _emit(self, outcome: AttackOutcome) -> None:
        setattr(self.stats, outcome.status, getattr(self.stats, outcome.status) + 1)
        self.stats.outcomes.append(outcome)
        try:
            self.on_outcome(outcome)
        except Exception:  # the pool must outlive a failing consumer
            log.error("attack outcome handler failed:\n%s", traceback.format_exc())

    def _collect(self) -> None:
        with self._lock:
            refs = list(self._busy)
            ready = ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs else []
            finished = [(ref, self._busy.pop(ref)) for ref in ready]
            now = time.monotonic()
            late = [(ref, d) for ref, d in self._busy.items() if now - d.started > d.limit]
            for ref, _ in late:
                self._busy.pop(ref)
        for ref, dispatch in finished:
            self._finish(ref, dispatch)
        for _, dispatch in late:
            self._replace(dispatch.worker)
            for obs in dispatch.observations:
                self._emit(AttackOutcome(obs, "timeout", error=f"no result within {dispatch.limit:.0f} s",
                                         seconds=now - dispatch.started, worker=dispatch.worker))

    def _finish(self, ref: Any, dispatch: _Dispatch) -> None:
        share = (time.monotonic() - dispatch.started) / len(dispatch.observations)
        try:
            reconstructions = ray.get(ref)
        except Exception as error:  # a worker's exception arrives wrapped by Ray
            message = f"{type(error).__name__}: {error}".strip()[-2000:]
            for obs in dispatch.observations:
                self._emit(AttackOutcome(obs, "error", error=message, seconds=share, worker=dispatch.worker))
            if isinstance(error, ray.exceptions.RayActorError):
                self._replace(dispatch.worker)
            return
        for index, obs in enumerate(dispatch.observations):
            if index < len(reconstructions):
                self._emit(AttackOutcome(obs, "ok", reconstructions[index], seconds=share, worker=dispatch.worker))
            else:
                self._emit(AttackOutcome(obs, "error", seconds=share, worker=dispatch.worker,
                                         error=f"the attack returned {len(reconstructions)} reconstructions "
                                               f"for {len(dispatch.observations)} observations"))

    def _replace(self, worker: int) -> None:
        ray.kill(self._workers[worker], no_restart=True)
        self._launch(worker)
        self.stats.restarts += 1

    def _loop(self) -> None:
        try:
            self._start()
        except Exception as error:
            self._start_error = f"attacker workers could not start: {type(error).__name__}: {error}"
            log.error("%s\n%s", self._start_error, traceback.format_exc())
            return
        while not self._closing.is_set():
            self._step()
            time.sleep(self._poll_seconds)

    def _step(self) -> None:
        try:
            self._collect()
            self._dispatch()
        except Exception:
            log.error("attack pool step failed:\n%s", traceback.format_exc())

    def close(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds (None: the per-attack limits alone) for every observation,
        report what is still unfinished as 'timeout', and stop the workers."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.pending() and self._thread.is_alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(self._poll_seconds)
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._workers and ray.is_initialized():
            self._collect()
        with self._lock:
            left = list(self._queue) + [obs for d in self._busy.values() for obs in d.observations]
            self._queue.clear()
            self._busy.clear()
        for obs in left:
            if self._start_error:
                self._emit(AttackOutcome(obs, "error", error=self._start_error))
            else:
                self._emit(AttackOutcome(obs, "timeout", error=f"still pending when the run ended (waited {timeout} s)"))
        for worker in self._workers:
            if worker is not None:
                ray.kill(worker, no_restart=True)
