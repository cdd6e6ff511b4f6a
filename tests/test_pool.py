"""The attacker pool: non-blocking submission, errors, time limits, closing and grouping.

Each test drives a real ``AttackPool`` on a local Ray cluster with a fake attack whose behaviour
is chosen per observation (``declared["behaviour"]``): return at once, sleep, raise or hang.
The fake attack returns, in each reconstruction's stats, which observations were attacked in the
same call, by which process, so the tests can see how the pool grouped and routed the work.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from attackers.base import AttackOutcome, Reconstruction
from attackers.pool import AttackPool
from attackers.runner import AttackSpec
from fedguard.data import DataSpec
from fedguard.observation import ModelCard, Observation
from tests.helpers import attacker_ray_cluster

pytestmark = pytest.mark.slow  # starts Ray and attacker processes

# Ray workers cannot import this test module (``tests`` is not installed): ship it by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CARD = ModelCard("mlp", {"hidden": 2, "depth": 0}, DataSpec(1, 2, 2, 2), ("0.weight", "0.bias"), (True, True))
ERROR_TEXT = "deliberate failure in the fake attack (code 4711)"


def observation(
    client: int, behaviour: str = "ok", seconds: float = 0.0, batch_size: int = 1, pid_file: str = ""
) -> Observation:
    """A tiny gradient observation of ``CARD``; ``behaviour`` tells the fake attack what to do with it."""
    arrays = [np.zeros((2, 4), np.float32), np.zeros(2, np.float32)]
    upload = [np.full((2, 4), client, np.float32), np.full(2, client, np.float32)]
    declared = {"batch-size": batch_size, "lr": 0.1, "behaviour": behaviour, "seconds": seconds, "pid-file": pid_file}
    return CARD.observe(1, client, "gradient", arrays, upload, batch_size, declared)


class FakeAttack:
    """Does what each observation's ``declared["behaviour"]`` says: 'ok', 'sleep', 'raise' or 'hang'."""

    needs: frozenset[str] = frozenset()

    def reconstruct_many(self, observations: list[Observation], seed: int) -> list[Reconstruction]:
        call = tuple(obs.client for obs in observations)
        for obs in observations:
            behaviour = obs.declared.extra["behaviour"]
            if behaviour == "raise":
                raise ValueError(ERROR_TEXT)
            if behaviour == "hang":
                if obs.declared.extra["pid-file"]:
                    Path(obs.declared.extra["pid-file"]).write_text(str(os.getpid()))
                time.sleep(1000)
            if behaviour == "sleep":
                time.sleep(obs.declared.extra["seconds"])
        return [
            Reconstruction(
                images=torch.full((obs.num_examples, *obs.spec.shape), 0.5),
                labels=torch.zeros(obs.num_examples, dtype=torch.long),
                stats={
                    "client": obs.client,
                    "group": len(observations),
                    "call": call,
                    "pid": os.getpid(),
                    "seed": seed,
                },
            )
            for obs in observations
        ]


class ShortAttack(FakeAttack):
    """Breaks the contract on groups: given several observations, returns one reconstruction fewer."""

    def reconstruct_many(self, observations: list[Observation], seed: int) -> list[Reconstruction]:
        done = super().reconstruct_many(observations, seed)
        return done[:-1] if len(observations) > 1 else done


class SlowStartAttack(FakeAttack):
    """A fake attack whose construction (in the worker) takes ``seconds``, like loading weights or CUDA."""

    def __init__(self, seconds: float) -> None:
        time.sleep(seconds)


def attack_with(resource: object) -> FakeAttack:
    """A factory taking an argument; given a lock, it cannot be shipped to a worker."""
    return FakeAttack()


class Outcomes:
    """Thread-safe ``on_outcome`` that records outcomes and the thread they arrive on."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.items: list[AttackOutcome] = []
        self.threads: set[str] = set()
        self.fail_on = fail_on
        self._lock = threading.Lock()

    def __call__(self, outcome: AttackOutcome) -> None:
        with self._lock:
            self.items.append(outcome)
            self.threads.add(threading.current_thread().name)
        if outcome.status == self.fail_on:
            raise RuntimeError("the consumer of outcomes failed")

    def of(self, obs: Observation) -> list[AttackOutcome]:
        with self._lock:
            return [o for o in self.items if o.observation is obs]

    def wait(self, count: int, timeout: float = 60.0) -> list[AttackOutcome]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.items) >= count:
                    return list(self.items)
            time.sleep(0.05)
        raise AssertionError(f"only {len(self.items)} of {count} outcomes after {timeout} s: {self.items}")


def assert_one_outcome_each(pool: AttackPool, outcomes: Outcomes, submitted: list[Observation]) -> None:
    """Every submitted observation got exactly one outcome, and the pool's counts agree."""
    counts = Counter(id(o.observation) for o in outcomes.items)
    assert {id(obs): 1 for obs in submitted} == dict(counts)
    assert pool.stats.submitted == len(submitted) == len(outcomes.items) == len(pool.stats.outcomes)
    assert pool.stats.ok + pool.stats.error + pool.stats.timeout == len(submitted)
    by_status = Counter(o.status for o in outcomes.items)
    assert (pool.stats.ok, pool.stats.error, pool.stats.timeout) == (
        by_status["ok"],
        by_status["error"],
        by_status["timeout"],
    )


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    with attacker_ray_cluster():
        yield


def process_ends(pid: int, timeout: float = 15.0) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def wait_until_started(pool: AttackPool, timeout: float = 60.0) -> None:
    """Block until every worker actor of ``pool`` has run its constructor (Ray's built-in ready probe)."""
    ray.get([worker.__ray_ready__.remote() for worker in pool.ray_workers.workers], timeout=timeout)


@pytest.fixture
def make_pool():
    """Builds pools of fake attacks (one worker, no grouping unless asked); closes any a failed test left open."""
    pools: list[AttackPool] = []

    def make(outcomes: Outcomes, factory=FakeAttack, attacks: list[AttackSpec] | None = None, **kwargs) -> AttackPool:
        options = {"workers": 1, "time_limit": 60.0, "group": 1, "poll_seconds": 0.05, **kwargs}
        pools.append(AttackPool(attacks or [AttackSpec("fake", functools.partial(factory))], outcomes, **options))
        return pools[-1]

    yield make
    for pool in pools:
        if pool._thread.is_alive():
            pool.close(timeout=0)


def test_submit_returns_at_once_and_every_observation_is_attacked(make_pool) -> None:
    outcomes = Outcomes()
    pool = make_pool(outcomes, workers=2, seed=11)
    submitted = [observation(c, "sleep", seconds=2.0) for c in range(3)]
    start = time.monotonic()
    for obs in submitted:
        pool.submit(obs)
    took = time.monotonic() - start
    assert took < 0.5, f"submit blocked for {took:.2f} s while the attack sleeps 2 s per observation"
    assert pool.pending() == 3
    outcomes.wait(3)
    pool.close(timeout=10)

    assert_one_outcome_each(pool, outcomes, submitted)
    assert outcomes.threads == {"attack-runner"}, "on_outcome must be called on the pool's thread"
    for obs in submitted:
        (outcome,) = outcomes.of(obs)
        assert outcome.status == "ok" and outcome.error is None
        rec = outcome.reconstruction
        assert rec.stats["client"] == obs.client and rec.stats["call"] == (obs.client,)
        assert rec.stats["seed"] == 11, "the pool hands the run's seed to the attack"
        assert rec.images.shape == (1, 1, 2, 2) and rec.labels.dtype == torch.long
        assert outcome.seconds >= 2.0
    assert {o.worker for o in outcomes.items} == {0, 1}, "both idle workers must get work"
    assert len({o.reconstruction.stats["pid"] for o in outcomes.items}) == 2
    assert pool.stats.ok == 3 and pool.stats.restarts == 0
    assert pool.pending() == 0


def test_an_attack_that_raises_yields_errors_and_the_pool_keeps_working(make_pool) -> None:
    outcomes = Outcomes(fail_on="error")  # the consumer failing as well must not stop the pool
    pool = make_pool(outcomes)
    failing = observation(0, "raise")
    pool.submit(failing)
    outcomes.wait(1)
    later = [observation(c) for c in (1, 2)]
    for obs in later:
        pool.submit(obs)
    outcomes.wait(3)
    pool.close(timeout=10)

    assert_one_outcome_each(pool, outcomes, [failing, *later])
    (error,) = outcomes.of(failing)
    assert error.status == "error" and error.reconstruction is None
    assert ERROR_TEXT in error.error and "ValueError" in error.error
    for obs in later:
        (outcome,) = outcomes.of(obs)
        assert outcome.status == "ok" and outcome.reconstruction.stats["client"] == obs.client
    assert (pool.stats.ok, pool.stats.error, pool.stats.timeout) == (2, 1, 0)
    assert pool.stats.restarts == 0, "an exception in the attack is no reason to restart the worker"


def test_an_attack_past_its_time_limit_times_out_and_its_worker_is_replaced(make_pool, tmp_path: Path) -> None:
    outcomes = Outcomes()
    pool = make_pool(outcomes, time_limit=3.0)
    # A worker takes about 4 s to start here, and the pool charges that to the first observation each worker
    # runs (see test_a_slow_worker_start_does_not_count_against_the_time_limit). With a 3 s limit, a warm-up
    # observation starts the workers (its outcome is 'timeout' while that bug lasts), and each observation below
    # is submitted once the current worker has started, so that the limit measures the attack alone.
    warm_up = observation(0)
    pool.submit(warm_up)
    outcomes.wait(1, timeout=30)
    wait_until_started(pool)
    restarts = pool.stats.restarts

    pid_file = tmp_path / "hanging.pid"
    hanging = observation(1, "hang", pid_file=str(pid_file))
    start = time.monotonic()
    pool.submit(hanging)
    outcomes.wait(2, timeout=30)
    waited = time.monotonic() - start
    assert pool.stats.restarts == restarts + 1
    hung_pid = int(pid_file.read_text())  # the attack did run, and hung
    wait_until_started(pool)
    later = observation(2)
    pool.submit(later)
    outcomes.wait(3)
    pool.close(timeout=10)

    assert_one_outcome_each(pool, outcomes, [warm_up, hanging, later])
    (timeout,) = outcomes.of(hanging)
    assert timeout.status == "timeout" and timeout.reconstruction is None
    assert "no result within 3 s" in timeout.error and timeout.seconds >= 3.0
    assert 3.0 <= waited < 10.0, f"the hanging attack was stopped after {waited:.1f} s, limit 3 s"
    (ok,) = outcomes.of(later)
    assert ok.status == "ok" and ok.reconstruction.stats["client"] == 2
    assert ok.reconstruction.stats["pid"] != hung_pid, "the later observation must run in the replacement process"
    assert process_ends(hung_pid), f"the hanging worker (pid {hung_pid}) was not killed"


def test_close_reports_what_is_left_as_timeout_within_its_timeout(make_pool) -> None:
    outcomes = Outcomes()
    pool = make_pool(outcomes, time_limit=600.0)
    done = observation(0)
    pool.submit(done)
    outcomes.wait(1)
    left = [observation(1, "hang"), observation(2, "hang")]  # one running, one still queued
    for obs in left:
        pool.submit(obs)
    time.sleep(0.3)
    assert pool.pending() == 2
    workers = list(pool.ray_workers.workers)
    start = time.monotonic()
    pool.close(timeout=2.0)
    took = time.monotonic() - start

    assert 2.0 <= took < 4.0, f"close(timeout=2) took {took:.1f} s"
    assert_one_outcome_each(pool, outcomes, [done, *left])
    assert outcomes.of(done)[0].status == "ok"
    for obs in left:
        (outcome,) = outcomes.of(obs)
        assert outcome.status == "timeout" and "still pending" in outcome.error
    assert pool.pending() == 0
    # close stops the workers: the one stuck in the hanging attack is gone
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(workers[0].run.remote("fake", [], 0), timeout=30)


def test_observations_of_one_shape_are_attacked_together_up_to_group(make_pool) -> None:
    outcomes = Outcomes()
    pool = make_pool(outcomes, group=3)
    # The blocker (a shape of its own: batch size 3) is first in the queue, so it is dispatched alone and keeps
    # the only worker busy while the rest is queued; then the queue is grouped deterministically.
    blocker = observation(0, "sleep", seconds=1.0, batch_size=3)
    same = [observation(c) for c in (1, 2, 3, 4)]
    other = [observation(c, batch_size=2) for c in (5, 6)]
    submitted = [blocker, same[0], same[1], other[0], same[2], same[3], other[1]]
    for obs in submitted:
        pool.submit(obs)
    outcomes.wait(len(submitted))
    pool.close(timeout=10)

    assert_one_outcome_each(pool, outcomes, submitted)
    assert all(o.status == "ok" for o in outcomes.items)
    calls = [o.reconstruction.stats["call"] for o in outcomes.items]
    # three of one shape in one call (the group limit), the other shape apart, the rest after
    assert list(dict.fromkeys(calls)) == [(0,), (1, 2, 3), (5, 6), (4,)]
    for o in outcomes.items:
        assert o.reconstruction.stats["client"] == o.observation.client
        assert o.reconstruction.stats["group"] == len(o.reconstruction.stats["call"])


def test_every_observation_of_a_group_gets_an_outcome_even_if_the_attack_returns_too_few(make_pool) -> None:
    outcomes = Outcomes()
    pool = make_pool(outcomes, factory=ShortAttack, group=3)
    blocker = observation(0, "sleep", seconds=1.0, batch_size=3)
    group = [observation(c) for c in (1, 2, 3)]
    for obs in [blocker, *group]:
        pool.submit(obs)
    outcomes.wait(3)
    time.sleep(0.5)
    pool.close(timeout=5)
    assert [o.status for o in outcomes.of(blocker)] == ["ok"]
    assert_one_outcome_each(pool, outcomes, [blocker, *group])
    assert [o.status for o in outcomes.of(group[2])] == ["error"]


def test_a_slow_worker_start_does_not_count_against_the_time_limit(make_pool) -> None:
    outcomes = Outcomes()
    pool = make_pool(outcomes, factory=functools.partial(SlowStartAttack, 3.0), time_limit=2.0)
    instant = observation(0)
    pool.submit(instant)
    outcomes.wait(1, timeout=30)
    pool.close(timeout=0)
    assert [o.status for o in outcomes.of(instant)] == ["ok"]


def test_a_pool_whose_workers_cannot_start_reports_each_observation_as_an_error(make_pool) -> None:
    outcomes = Outcomes()
    pool = make_pool(outcomes, factory=functools.partial(attack_with, threading.Lock()))  # not picklable
    obs = observation(0)
    start = time.monotonic()
    pool.submit(obs)
    assert time.monotonic() - start < 0.5
    pool.close(timeout=20)
    assert_one_outcome_each(pool, outcomes, [obs])
    (outcome,) = outcomes.items
    assert outcome.status == "error"
    assert "attacker workers could not start" in outcome.error and "_thread.lock" in outcome.error


def test_submit_after_a_failed_start_still_returns_and_is_reported(make_pool) -> None:
    outcomes = Outcomes()
    pool = make_pool(outcomes, factory=functools.partial(attack_with, threading.Lock()))
    first, second = observation(0), observation(1)
    pool.submit(first)
    pool._thread.join(timeout=20)  # the start has failed and the pool's thread has ended
    assert not pool._thread.is_alive()
    pool.submit(second)
    pool.close(timeout=5)
    assert_one_outcome_each(pool, outcomes, [first, second])
    assert [o.status for o in outcomes.items] == ["error", "error"]


def test_each_observation_goes_to_every_attack_that_exploits_its_manipulation(make_pool) -> None:
    outcomes = Outcomes()
    attacks = [
        AttackSpec("honest-a", FakeAttack),
        AttackSpec("honest-b", FakeAttack),
        AttackSpec("trap", FakeAttack, manipulation="trap-weights"),
    ]
    pool = make_pool(outcomes, attacks=attacks, group=4)
    honest = observation(0)
    trapped = dataclasses.replace(observation(1), manipulation="trap-weights")
    other = dataclasses.replace(observation(2), manipulation="imprint")
    for obs in (honest, trapped, other):
        pool.submit(obs)
    assert pool.stats.submitted == 3  # two for the honest upload, one for the trapped one, none for 'imprint'
    outcomes.wait(3)
    pool.close(timeout=10)
    got = sorted((o.attack, o.observation.client, o.status) for o in outcomes.items)
    assert got == [("honest-a", 0, "ok"), ("honest-b", 0, "ok"), ("trap", 1, "ok")]
    assert all(o.reconstruction.stats["group"] == 1 for o in outcomes.items), "attacks are never grouped together"


def test_a_warmed_up_pool_has_its_workers_up_before_the_first_submit_and_groups_a_held_batch(make_pool) -> None:
    outcomes = Outcomes()
    pool = make_pool(outcomes, group=4)
    pool.warm_up()  # Ray is up (the fixture's cluster), as inside a simulation
    deadline = time.monotonic() + 60
    while not (pool.ray_workers.workers and all(pool.ray_workers.workers)) and time.monotonic() < deadline:
        time.sleep(0.05)  # the pool's thread creates the workers
    wait_until_started(pool)  # the workers exist and ran their constructor, with nothing submitted
    assert pool.stats.submitted == 0
    batch = [observation(c) for c in range(4)]
    with pool.held():
        for obs in batch:
            pool.submit(obs)
            time.sleep(0.15)  # three of the pool's polls between two submits: a free worker would take each alone
    outcomes.wait(len(batch))
    pool.close(timeout=10)
    assert [o.reconstruction.stats["call"] for o in outcomes.items] == [(0, 1, 2, 3)] * 4, "the held round as one"
