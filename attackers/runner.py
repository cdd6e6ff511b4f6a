"""The attack runner: schedules the configured attacks on captured observations, whoever runs them.

``submit`` queues one task per attack that applies to the observation (the attack exploits the manipulation the
upload was computed under, 'none' for an honest server) and returns at once. A background thread hands queued
tasks to the idle workers of a backend (up to ``group`` observations of one attack and shape at a time, which the
attack runs as one batch), collects results as they arrive and passes every outcome, good or bad, to
``on_outcome``. An attack that raises on a batch is run again on each of its observations alone, so that only the
one it fails on yields an 'error' outcome; a worker that runs past its time limit is replaced and yields a
'timeout' outcome. ``close`` waits for what is left up to a limit and reports the rest as 'timeout', or as
'interrupted' once ``stop`` says the run is stopping (then nothing more is dispatched and ``close`` does not wait).

Two backends (``Workers``): ``LocalWorkers`` here, one worker in this process (``fedguard attack`` and
``fedguard.attack``), and ``attackers.pool.RayWorkers``, Ray actors beside a live run's clients
(``attackers.pool.AttackPool``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from attackers.base import (
    AttackOutcome,
    Chosen,
    Reconstruction,
    attack_traits,
    build_attack,
    required_manipulation,
    shape_key,
)
from fedguard.observation import Observation

log = logging.getLogger(__name__)

AttackFactory = Callable[[], Any]


@dataclass(frozen=True)
class AttackSpec:
    """One attack the runner schedules: its name, a picklable factory, and the manipulation it exploits."""

    name: str
    factory: AttackFactory
    manipulation: str = "none"


def attack_specs(chosen: Iterable[Chosen], defense: tuple[str, Any] | None) -> list[AttackSpec]:
    """The specs of the configured attacks (``fedguard.config.Config.attacks``), each built knowing the clients'
    ``defense`` (name, parameters)."""
    return [
        AttackSpec(
            a.name,
            functools.partial(build_attack, a.name, a.params, defense),
            required_manipulation(attack_traits(a.name, a.params)),
        )
        for a in chosen
    ]


class AttackWorker:
    """What one worker runs: builds the attacks once, then reconstructs what it is given."""

    def __init__(self, factories: dict[str, AttackFactory], threads: int | None = None) -> None:
        if threads is not None:
            torch.set_num_threads(max(1, threads))
        self.attacks = {name: factory() for name, factory in factories.items()}

    def run(self, attack: str, observations: list[Observation], seed: int) -> list[Reconstruction]:
        return self.attacks[attack].reconstruct_many(observations, seed)


@dataclass(frozen=True, eq=False)  # a handle of LocalWorkers: hashed by identity
class Finished:
    """What came back of one batch: its reconstructions, or ``failure`` (the error, as text) and whether the
    worker was ``lost`` with it; ``ended``: when it ended (``time.monotonic``), None when the backend cannot say."""

    reconstructions: list[Reconstruction] | None
    failure: str | None = None
    lost: bool = False
    ended: float | None = None


class Workers(Protocol):
    """A runner's backend: numbered workers that each run one batch at a time.

    ``start`` creates them (on the runner's thread, at the first submit or ``warm_up``);
    ``idle`` is those up and free of the ``busy`` ones; ``send`` hands one a batch and returns a handle;
    ``finished`` is the handles whose batch ended; ``result`` what came back of one; ``replace`` kills a worker and
    starts another in its place (one past its time limit, or lost); ``stop`` ends them all. ``starts_early``:
    whether they may start before the first observation (``AttackRunner.warm_up``)."""

    def starts_early(self) -> bool: ...

    def start(self, factories: dict[str, AttackFactory]) -> None: ...

    def idle(self, busy: set[int]) -> list[int]: ...

    def send(self, worker: int, attack: str, observations: list[Observation], seed: int) -> Any: ...

    def finished(self, handles: list[Any]) -> list[Any]: ...

    def result(self, handle: Any) -> Finished: ...

    def replace(self, worker: int) -> None: ...

    def stop(self) -> None: ...


class LocalWorkers:
    """One worker in this process: each batch runs as it is sent, on the runner's thread, so a time limit cannot
    stop it midway (give the runner no limit, ``math.inf``); no Ray, no other process."""

    def __init__(self) -> None:
        self.worker: AttackWorker | None = None

    def starts_early(self) -> bool:
        return False

    def start(self, factories: dict[str, AttackFactory]) -> None:
        self.worker = AttackWorker(factories)

    def idle(self, busy: set[int]) -> list[int]:
        return [] if busy else [0]

    def send(self, worker: int, attack: str, observations: list[Observation], seed: int) -> Finished:
        assert self.worker is not None, "send before start"
        try:
            reconstructions = self.worker.run(attack, observations, seed)
        except Exception as error:
            failure = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=3)}"
            return Finished(None, failure, ended=time.monotonic())
        return Finished(reconstructions, ended=time.monotonic())

    def finished(self, handles: list[Any]) -> list[Any]:
        return handles

    def result(self, handle: Any) -> Finished:
        return handle

    def replace(self, worker: int) -> None:
        """Nothing: a batch run in this process has always ended by the time it is collected."""

    def stop(self) -> None:
        self.worker = None


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
class RunnerStats:
    """Counts of outcomes so far."""

    submitted: int = 0
    ok: int = 0
    error: int = 0
    timeout: int = 0
    interrupted: int = 0
    restarts: int = 0
    split_batches: int = 0  # batches that raised and were run again one observation at a time
    outcomes: list[AttackOutcome] = field(default_factory=list)


class AttackRunner:
    """The configured attacks fed to a backend's workers without blocking; see the module docstring.

    Parameters
    ----------
    attacks : list[AttackSpec]
        The attacks; their factories build them inside each worker.
    on_outcome : Callable[[AttackOutcome], None]
        Called, on the runner's thread, once for every (attack, observation) task.
    backend : Workers
        Who runs the batches (``LocalWorkers``, ``attackers.pool.RayWorkers``).
    time_limit : float
        Seconds one observation may take; a group of k gets k times as long.
    group : int
        Most observations of one attack and shape given to a worker at once.
    seed : int
        The run's seed, handed to every ``reconstruct_many`` (it fixes the attacks' starting points).
    stop : Callable[[], str | None]
        Why the run is stopping early, or None while it goes on (see ``fedguard.runtime.stopping``).
    poll_seconds : float
        How long the runner's thread sleeps when a pass found nothing to collect or dispatch.
    """

    def __init__(
        self,
        attacks: list[AttackSpec],
        on_outcome: Callable[[AttackOutcome], None],
        backend: Workers,
        time_limit: float = 600.0,
        group: int = 4,
        seed: int = 0,
        stop: Callable[[], str | None] = lambda: None,
        poll_seconds: float = 0.2,
    ) -> None:
        if not time_limit > 0:
            raise ValueError(f"time_limit must be > 0, got {time_limit}")
        if group < 1:
            raise ValueError(f"group must be >= 1, got {group}")
        if not attacks:
            raise ValueError("the runner needs at least one attack")
        if len({a.name for a in attacks}) < len(attacks):
            raise ValueError(f"attack names repeat: {[a.name for a in attacks]}")
        self.attacks = list(attacks)
        self.on_outcome = on_outcome
        self.backend = backend
        self.time_limit = time_limit
        self.group = group
        self.seed = seed
        self.stop = stop
        self.stats = RunnerStats()
        self._poll_seconds = poll_seconds
        self._last_failure = ""
        self._start_error: str | None = None
        self._running = False  # the backend's workers are up
        self._started = False
        self._held = 0
        self._busy: dict[Any, _Dispatch] = {}
        self._in_hand = 0  # tasks whose batch ended, taken off ``_busy``, whose outcomes are not all emitted yet
        self._queue: deque[_Task] = deque()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="attack-runner", daemon=True)

    def warm_up(self) -> None:
        """Start the workers now rather than at the first submit, where the backend allows it
        (``Workers.starts_early``); otherwise nothing."""
        if not self.backend.starts_early():
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
                raise RuntimeError("the attack runner is closed; no more observations are taken")
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
        """Tasks (attack, observation) queued, running, or ended and not yet reported."""
        with self._lock:
            return len(self._queue) + sum(len(d.observations) for d in self._busy.values()) + self._in_hand

    def _dispatch(self) -> bool:
        """Hand queued tasks to idle workers; whether any was handed."""
        if self._closing.is_set() or self.stop() is not None:
            return False
        with self._lock:
            if self._held:
                return False
            sent = False
            for worker in self.backend.idle({d.worker for d in self._busy.values()}):
                if not self._queue:
                    break
                first = self._queue.popleft()
                group = [first.observation] if first.alone else self._group_with(first)
                started = time.monotonic()
                handle = self.backend.send(worker, first.attack, group, self.seed)
                self._busy[handle] = _Dispatch(worker, first.attack, group, started, self.time_limit * len(group))
                sent = True
            return sent

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
        except Exception:  # the runner must outlive a failing consumer
            log.error("attack outcome handler failed:\n%s", traceback.format_exc())

    def _collect(self) -> bool:
        """Emit the outcomes of the batches that ended and of those past their limit; whether there were any."""
        with self._lock:
            ended = self.backend.finished(list(self._busy)) if self._busy else []
            finished = [(self.backend.result(handle), self._busy.pop(handle)) for handle in ended]
            now = time.monotonic()
            late = [(handle, d) for handle, d in self._busy.items() if now - d.started > d.limit]
            for handle, _ in late:
                self._busy.pop(handle)
            self._in_hand = sum(len(d.observations) for _, d in finished) + sum(len(d.observations) for _, d in late)
        for result, dispatch in finished:
            self._finish(result, dispatch)
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
        with self._lock:
            self._in_hand = 0
        return bool(finished or late)

    def _finish(self, result: Finished, dispatch: _Dispatch) -> None:
        ended = time.monotonic() if result.ended is None else result.ended
        share = (ended - dispatch.started) / len(dispatch.observations)
        if result.lost:
            self._replace(dispatch.worker)
        if result.reconstructions is None:
            if len(dispatch.observations) > 1:
                self._split(dispatch, result.failure or "")
                return
            outcome = AttackOutcome(
                dispatch.observations[0],
                "error",
                error=(result.failure or "the attack failed").strip()[-2000:],
                seconds=share,
                worker=dispatch.worker,
                attack=dispatch.attack,
            )
            self._emit(outcome)
            return
        reconstructions = result.reconstructions
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

    def _split(self, dispatch: _Dispatch, failure: str) -> None:
        """Queue each observation of a batch that raised first, alone: only those the attack fails on alone
        end as 'error'."""
        log.warning(
            "%s raised on a batch of %d uploads (%s); running each alone",
            dispatch.attack,
            len(dispatch.observations),
            failure.split(":", 1)[0],
        )
        with self._lock:
            self._queue.extendleft(_Task(dispatch.attack, obs, alone=True) for obs in reversed(dispatch.observations))
            self.stats.split_batches += 1

    def _replace(self, worker: int) -> None:
        self.backend.replace(worker)
        self.stats.restarts += 1

    def _loop(self) -> None:
        try:
            self.backend.start({a.name: a.factory for a in self.attacks})
            self._running = True
        except Exception as error:
            self._start_error = f"attacker workers could not start: {type(error).__name__}: {error}"
            log.error("%s\n%s", self._start_error, traceback.format_exc())
            return
        while not self._closing.is_set():
            if not self._step():
                time.sleep(self._poll_seconds)

    def _step(self) -> bool:
        """One pass: collect, then dispatch; whether it did anything."""
        try:
            progressed = self._collect()
            progressed = self._dispatch() or progressed
            self._last_failure = ""
            return progressed
        except Exception as error:
            failure = f"{type(error).__name__}: {error}"
            if failure != self._last_failure:  # the same failure every poll is logged once
                log.error("attack runner step failed:\n%s", traceback.format_exc())
            self._last_failure = failure
            return False

    def _unfinished(self, task: _Task, timeout: float | None, seconds: float = 0.0, worker: int = -1) -> AttackOutcome:
        """The outcome of a task still queued, or running for ``seconds`` on ``worker``, when the runner closes."""
        if self._start_error:
            return AttackOutcome(task.observation, "error", error=self._start_error, attack=task.attack)
        reason = self.stop()
        if reason is not None:
            status, error = "interrupted", f"the run was {reason} before this attack finished"
        else:
            waited = "" if timeout is None else f" (waited {timeout:.0f} s)"
            status, error = "timeout", f"still pending when the run ended{waited}"
        return AttackOutcome(task.observation, status, attack=task.attack, seconds=seconds, worker=worker, error=error)

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
            time.sleep(min(self._poll_seconds, 0.05))
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._running:
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
        if self._running:
            self.backend.stop()
