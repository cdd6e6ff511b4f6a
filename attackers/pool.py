"""The attacker pool: Ray actors that run the configured attacks on captured observations.

The pool is an ``ObservationSink``: ``submit`` queues one task per attack that
applies to the observation (the attack exploits the manipulation the upload
was computed under, 'none' for an honest server) and returns at once, so
aggregation never waits. A background thread hands queued tasks to idle
workers (up to ``group`` observations of one attack and shape at a time, which
the attack runs as one batch), collects results as they arrive and passes
every outcome, good or bad, to ``on_outcome``. An attack that raises on a batch is run again on each of
its observations alone, so that only the one it fails on yields an 'error' outcome; a worker that runs
past its time limit is killed, replaced, and yields a 'timeout' outcome. ``close`` waits for what is left
up to a limit and reports the rest as 'timeout', or as 'interrupted' once ``stop`` says the run is
stopping (then nothing more is dispatched and ``close`` does not wait).

Workers take one GPU each when CUDA is visible and the attack's device is not
'cpu' and Ray has a whole GPU free; when the simulated clients hold every GPU share
(``sim.client-gpus``), they use the device beside them without a Ray claim (``gpu_options``).
Otherwise they take CPU threads. Inside a Flower simulation the pool
uses the simulation's Ray cluster; elsewhere it starts a local one, or joins
the cluster at ``address``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from attackers.base import AttackOutcome, Reconstruction, shape_key
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


AttackFactory = Callable[[], Any]


@dataclass(frozen=True)
class AttackSpec:
    """One attack the pool runs: its name, a picklable factory, and the manipulation it exploits."""

    name: str
    factory: AttackFactory
    manipulation: str = "none"


class AttackWorker:
    """One attacker process: builds the attacks once, then reconstructs what it is given."""

    def __init__(self, factories: dict[str, AttackFactory], threads: int) -> None:
        torch.set_num_threads(max(1, threads))
        self.attacks = {name: factory() for name, factory in factories.items()}

    def run(self, attack: str, observations: list[Observation], seed: int) -> list[Reconstruction]:
        return self.attacks[attack].reconstruct_many(observations, seed)


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


@dataclass
class _Task:
    attack: str
    observation: Observation
    alone: bool = False  # a retry after its batch raised: dispatched in a group of its own


@dataclass
class _Dispatch:
    worker: int
    attack: str
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
    interrupted: int = 0
    restarts: int = 0
    split_batches: int = 0  # batches that raised and were run again one observation at a time
    outcomes: list[AttackOutcome] = field(default_factory=list)


class AttackPool:
    """Ray attacker workers fed without blocking; see the module docstring.

    Parameters
    ----------
    attacks : list[AttackSpec]
        The attacks; their factories build them inside each worker (must be picklable).
    on_outcome : Callable[[AttackOutcome], None]
        Called, on the pool's thread, once for every (attack, observation) task.
    workers : int
        Number of worker actors (>= 1).
    time_limit : float
        Seconds one observation may take; a group of k gets k times as long.
    group : int
        Most observations of one attack and shape given to a worker at once.
    threads : int
        Torch threads of each CPU worker.
    use_gpu : bool
        Workers on the GPU (only when CUDA is visible; see ``gpu_options``).
    address : str | None
        Address of an existing Ray cluster to join when Ray is not running yet.
    seed : int
        The run's seed, handed to every ``reconstruct_many`` (it fixes the attacks' starting points).
    stop : Callable[[], str | None]
        Why the run is stopping early, or None while it goes on (see ``fedguard.runtime.stopping``).
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
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if not time_limit > 0:
            raise ValueError(f"time_limit must be > 0, got {time_limit}")
        if group < 1:
            raise ValueError(f"group must be >= 1, got {group}")
        if not attacks:
            raise ValueError("the pool needs at least one attack")
        if len({a.name for a in attacks}) < len(attacks):
            raise ValueError(f"attack names repeat: {[a.name for a in attacks]}")
        self.attacks = list(attacks)
        self.on_outcome = on_outcome
        self.time_limit = time_limit
        self.group = group
        self.threads = threads
        self.use_gpu = use_gpu and torch.cuda.is_available()
        self.stats = PoolStats()
        self.num_workers = workers
        self.address = address
        self.seed = seed
        self.stop = stop
        self._last_failure = ""
        self._has_resource = False
        self._gpu_options: dict[str, Any] = {}
        self._start_error: str | None = None
        self._workers: list[Any] = []
        self._ready: list[bool] = []
        self._ready_refs: dict[Any, int] = {}
        self._started = False
        self._held = 0
        self._busy: dict[ray.ObjectRef[Any], _Dispatch] = {}
        self._queue: deque[_Task] = deque()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._poll_seconds = poll_seconds
        self._thread = threading.Thread(target=self._loop, name="attack-pool", daemon=True)

    def _start(self) -> None:
        """Join (or start) Ray and create the workers. Runs on the pool's thread at the first submit, so
        that inside a simulation the engine has started Ray by then and the pool never races it."""
        if not ray.is_initialized():
            resources: dict[str, float] | None = None if self.address else {ATTACKER_RESOURCE: self.num_workers}
            ray.init(address=self.address, include_dashboard=False, resources=resources)
        self._has_resource = ray.cluster_resources().get(ATTACKER_RESOURCE, 0) >= 1
        self._gpu_options = gpu_options(ray.available_resources().get("GPU", 0.0)) if self.use_gpu else {}
        if self._gpu_options.get("num_gpus") == 0:
            log.warning(
                "the attack workers share the GPU with the simulated clients: Ray has no whole GPU free "
                "(sim.client-gpus reserved it), so they run on it without a Ray claim"
            )
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
        options.update(self._gpu_options)
        factories = {a.name: a.factory for a in self.attacks}
        return AttackWorkerActor.options(**options).remote(Call(AttackWorker, factories, self.threads))

    def warm_up(self) -> None:
        """Start the workers now rather than at the first submit, where Ray is already up (inside a simulation,
        whose engine started it) and the workers claim no GPU (on a GPU they start at the first submit, once
        the simulated clients took their share of it); otherwise nothing."""
        if self.use_gpu or not ray.is_initialized():
            return
        with self._lock:
            if not self._started and not self._closing.is_set():
                self._started = True
                self._thread.start()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Nothing is dispatched while the block runs: the observations submitted in it (one round's) are
        grouped as if they had come at once, however soon a worker is free."""
        with self._lock:
            self._held += 1
        try:
            yield
        finally:
            with self._lock:
                self._held -= 1

    def submit(self, obs: Observation) -> None:
        """Queue one task per attack that applies to ``obs``; returns immediately. Raises ``RuntimeError``
        after ``close``."""
        tasks = [_Task(a.name, obs) for a in self.attacks if a.manipulation == obs.manipulation]
        with self._lock:
            if self._closing.is_set():
                raise RuntimeError("the attack pool is closed; no more observations are taken")
            if not tasks:
                log.info(
                    "round %d client %d: no configured attack exploits manipulation %r",
                    obs.round,
                    obs.client,
                    obs.manipulation,
                )
                return
            self._queue.extend(tasks)
            self.stats.submitted += len(tasks)
            if not self._started:
                self._started = True
                self._thread.start()

    def pending(self) -> int:
        """Tasks (attack, observation) queued or running."""
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
        if self._closing.is_set() or self.stop() is not None:
            return
        with self._lock:
            if self._held:
                return
            for worker in self._idle_workers():
                if not self._queue:
                    return
                first = self._queue.popleft()
                group = [first.observation] if first.alone else self._group_with(first)
                ref = self._workers[worker].run.remote(first.attack, group, self.seed)
                self._busy[ref] = _Dispatch(worker, first.attack, group, time.monotonic(), self.time_limit * len(group))

    def _group_with(self, first: _Task) -> list[Observation]:
        """``first`` and up to ``group - 1`` queued tasks of its attack and shape, taken off the queue."""
        key = (first.attack, shape_key(first.observation))
        group = [first.observation]
        for task in list(self._queue):
            if len(group) >= self.group:
                break
            if not task.alone and (task.attack, shape_key(task.observation)) == key:
                group.append(task.observation)
                self._queue.remove(task)
        return group

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
                self._emit(
                    AttackOutcome(
                        obs,
                        "timeout",
                        error=f"no result within {dispatch.limit:.0f} s",
                        seconds=now - dispatch.started,
                        worker=dispatch.worker,
                        attack=dispatch.attack,
                    )
                )

    def _finish(self, ref: Any, dispatch: _Dispatch) -> None:
        share = (time.monotonic() - dispatch.started) / len(dispatch.observations)
        try:
            reconstructions = ray.get(ref)
        except Exception as error:  # a worker's exception arrives wrapped by Ray
            if isinstance(error, ray.exceptions.RayActorError):
                self._replace(dispatch.worker)
            if len(dispatch.observations) > 1:
                self._split(dispatch, error)
                return
            message = f"{type(error).__name__}: {error}".strip()[-2000:]
            self._emit(
                AttackOutcome(
                    dispatch.observations[0],
                    "error",
                    error=message,
                    seconds=share,
                    worker=dispatch.worker,
                    attack=dispatch.attack,
                )
            )
            return
        for index, obs in enumerate(dispatch.observations):
            if index < len(reconstructions):
                self._emit(
                    AttackOutcome(
                        obs, "ok", reconstructions[index], seconds=share, worker=dispatch.worker, attack=dispatch.attack
                    )
                )
            else:
                self._emit(
                    AttackOutcome(
                        obs,
                        "error",
                        seconds=share,
                        worker=dispatch.worker,
                        attack=dispatch.attack,
                        error=f"the attack returned {len(reconstructions)} reconstructions "
                        f"for {len(dispatch.observations)} observations",
                    )
                )

    def _split(self, dispatch: _Dispatch, error: Exception) -> None:
        """Queue each observation of a batch that raised first, alone: only those the attack fails on alone
        end as 'error'."""
        log.warning(
            "%s raised on a batch of %d uploads (%s); running each alone",
            dispatch.attack,
            len(dispatch.observations),
            type(error).__name__,
        )
        with self._lock:
            self._queue.extendleft(_Task(dispatch.attack, obs, alone=True) for obs in reversed(dispatch.observations))
            self.stats.split_batches += 1

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
            self._last_failure = ""
        except Exception as error:
            failure = f"{type(error).__name__}: {error}"
            if failure != self._last_failure:  # the same failure every poll is logged once
                log.error("attack pool step failed:\n%s", traceback.format_exc())
            self._last_failure = failure

    def _unfinished(self, task: _Task, timeout: float | None, seconds: float = 0.0, worker: int = -1) -> AttackOutcome:
        """The outcome of a task still queued, or running for ``seconds`` on ``worker``, when the pool closes."""
        if self._start_error:
            return AttackOutcome(task.observation, "error", error=self._start_error, attack=task.attack)
        reason = self.stop()
        if reason is not None:
            return AttackOutcome(
                task.observation,
                "interrupted",
                attack=task.attack,
                seconds=seconds,
                worker=worker,
                error=f"the run was {reason} before this attack finished",
            )
        waited = "" if timeout is None else f" (waited {timeout:.0f} s)"
        return AttackOutcome(
            task.observation,
            "timeout",
            attack=task.attack,
            seconds=seconds,
            worker=worker,
            error=f"still pending when the run ended{waited}",
        )

    def close(self, timeout: float | None = None) -> None:
        """Wait up to ``timeout`` seconds (None: the per-attack limits alone), or until ``stop`` says the run
        is stopping, for every observation; report what is still unfinished as 'timeout' or 'interrupted', and
        stop the workers."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (
            self.pending()
            and self._thread.is_alive()
            and self.stop() is None
            and (deadline is None or time.monotonic() < deadline)
        ):
            time.sleep(self._poll_seconds)
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._workers and ray.is_initialized():
            self._step()  # results that came in meanwhile; nothing is dispatched once closing
        now = time.monotonic()
        with self._lock:
            left = [self._unfinished(task, timeout) for task in self._queue]
            left += [
                self._unfinished(_Task(d.attack, obs), timeout, (now - d.started) / len(d.observations), d.worker)
                for d in self._busy.values()
                for obs in d.observations
            ]
            self._queue.clear()
            self._busy.clear()
        for outcome in left:
            self._emit(outcome)
        self._stop_workers()

    def _stop_workers(self) -> None:
        """Kill every worker; one that cannot be reached (Ray already gone) is left to Ray's own ending."""
        for worker in self._workers:
            if worker is None:
                continue
            try:
                ray.kill(worker, no_restart=True)
            except Exception as error:
                log.warning("attacker worker not stopped: %s: %s", type(error).__name__, error)
