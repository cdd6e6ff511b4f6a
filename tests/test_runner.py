"""The attack runner on its in-process backend (``LocalWorkers``), as ``fedguard attack`` and ``fedguard.attack``
run it; the same runner on Ray actors is ``tests/test_pool.py``'s."""

from __future__ import annotations

import functools
import math

import pytest

from attackers.runner import AttackRunner, AttackSpec, LocalWorkers
from tests.test_pool import FakeAttack, Outcomes, ShortAttack, observation


def run_locally(outcomes: Outcomes, observations: list, factory=FakeAttack, group: int = 4) -> AttackRunner:
    runner = AttackRunner([AttackSpec("fake", functools.partial(factory))], outcomes, LocalWorkers(), math.inf, group)
    with runner.held():
        for obs in observations:
            runner.submit(obs)
    runner.close()
    return runner


def test_a_held_batch_runs_in_groups_of_group_in_the_order_submitted() -> None:
    outcomes = Outcomes()
    runner = run_locally(outcomes, [observation(c) for c in range(5)], group=2)
    calls = [o.reconstruction.stats["call"] for o in outcomes.items]
    assert calls == [(0, 1), (0, 1), (2, 3), (2, 3), (4,)]
    assert (runner.stats.submitted, runner.stats.ok, runner.pending()) == (5, 5, 0)
    assert outcomes.threads == {"attack-runner"}


def test_an_outcome_takes_the_seconds_its_batch_ran_shared_among_its_uploads() -> None:
    outcomes = Outcomes()
    run_locally(outcomes, [observation(c, "sleep", seconds=0.3) for c in range(2)], group=2)
    assert [o.status for o in outcomes.items] == ["ok", "ok"]
    for outcome in outcomes.items:
        assert 0.3 <= outcome.seconds < 0.45, outcome.seconds  # 0.6 s for two, not a poll's wait more


def test_too_few_reconstructions_are_errors_for_the_uploads_left_without_one() -> None:
    outcomes = Outcomes()
    run_locally(outcomes, [observation(c) for c in range(3)], factory=ShortAttack)
    assert [o.status for o in outcomes.items] == ["ok", "ok", "error"]
    assert "returned 2 reconstructions for 3 observations" in outcomes.items[-1].error


def broken_attack() -> FakeAttack:
    raise FileNotFoundError("denoiser.pt is missing (code 4713)")


def test_attacks_that_cannot_be_built_end_every_upload_as_an_error_naming_why() -> None:
    outcomes = Outcomes()
    runner = run_locally(outcomes, [observation(c) for c in range(2)], factory=broken_attack)
    assert [o.status for o in outcomes.items] == ["error", "error"]
    assert all("could not start" in o.error and "code 4713" in o.error for o in outcomes.items)
    with pytest.raises(RuntimeError, match="closed"):
        runner.submit(observation(3))
