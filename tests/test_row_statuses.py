"""Every attacked upload ends as exactly one row of attacks.jsonl, whose status says what became of it.

A scoring failure is a 'score-error' row, not a lost one; an attack that raises on a batch fails only the
uploads it fails on alone; a stopped run's attacks are 'interrupted'; the summary and the report count rows
by status; and no ``pool.wait`` loses the end of the run.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch

import fedguard.evaluation
from attackers.base import AttackOutcome, Reconstruction
from attackers.pool import AttackPool
from attackers.runner import AttackRunner, AttackSpec, LocalWorkers
from attackers.sinks import FanOut
from fedguard.config import ConfigError, load_config
from fedguard.evaluation import ROW_STATUSES, Evaluator, status_counts
from fedguard.report.html import build_report
from fedguard.report.rounds import RoundRecorder
from fedguard.runtime.server_app import finish_run
from fedguard.runtime.stopping import StopRequest
from fedguard.store.folder import ATTACKS_FILE, STATUS_FILE, read_json
from fedguard.store.observation_files import DiskSink, load_observations
from fedguard.store.run_dir import OBSERVATIONS_DIR, ROUNDS_FILE
from fedguard.tracking import Trackers
from tests.helpers import attacker_ray_cluster
from tests.test_evaluation import make_run
from tests.test_pool import ERROR_TEXT, FakeAttack, Outcomes, observation

# Ray workers cannot import this test module (``tests`` is not installed): ship it by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

CONTEXTS = {"ig": {"attack": "ig", "defense": "none", "seed": 0}}


def rows_of(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / ATTACKS_FILE).read_text().splitlines()]


def test_a_scoring_failure_is_a_score_error_row_not_a_lost_one(tmp_path: Path, monkeypatch) -> None:
    folder = make_run(tmp_path, batch=2, clients=2)
    first, second = load_observations(folder / OBSERVATIONS_DIR)
    evaluator = Evaluator(folder, CONTEXTS)
    exact = Reconstruction(torch.rand(2, *first.spec.shape), torch.zeros(2, dtype=torch.long), {})
    assert evaluator(AttackOutcome(first, "ok", exact, attack="ig"))["status"] == "ok"

    def broken(*args, **kwargs):
        raise RuntimeError("the scorer broke (code 4712)")

    monkeypatch.setattr(fedguard.evaluation, "score_batch", broken)
    row = evaluator(AttackOutcome(second, "ok", exact, seconds=2.0, attack="ig"))

    assert row["status"] == "score-error" and "code 4712" in row["error"] and row["psnr"] is None
    assert [(r["client"], r["status"]) for r in rows_of(folder)] == [(0, "ok"), (1, "score-error")]
    assert status_counts(rows_of(folder)) == "1 ok, 1 score-error"


def test_status_counts_name_every_status_present_in_order() -> None:
    rows = [{"status": s} for s in ("interrupted", "ok", "error", "ok", "score-error", "interrupted")]
    assert status_counts(rows) == "2 ok, 1 error, 1 score-error, 2 interrupted"
    assert status_counts([]) == "0 ok"
    assert set(ROW_STATUSES) == {"ok", "error", "timeout", "score-error", "interrupted"}


class PickyAttack:
    """Raises when any upload of the batch is client 1's, like an attack that breaks on one bad upload."""

    def reconstruct_many(self, observations: list, seed: int) -> list[Reconstruction]:
        if any(obs.client == 1 for obs in observations):
            raise ValueError(ERROR_TEXT)
        return [
            Reconstruction(
                torch.rand(obs.num_examples, *obs.spec.shape), torch.zeros(obs.num_examples, dtype=torch.long), {}
            )
            for obs in observations
        ]


def test_offline_a_batch_that_raises_fails_only_the_upload_it_fails_on(tmp_path: Path) -> None:
    folder = make_run(tmp_path, batch=1, clients=3)
    group = load_observations(folder / OBSERVATIONS_DIR)
    evaluator = Evaluator(folder, CONTEXTS)
    rows: list[dict] = []
    specs = [AttackSpec("ig", PickyAttack)]
    runner = AttackRunner(specs, lambda o: rows.append(evaluator(o)), LocalWorkers(), math.inf)
    with runner.held():
        for obs in group:
            runner.submit(obs)
    runner.close()
    assert sorted((r["client"], r["status"]) for r in rows) == [(0, "ok"), (1, "error"), (2, "ok")]
    assert ERROR_TEXT in next(r["error"] for r in rows if r["client"] == 1)
    assert len(rows_of(folder)) == 3 and runner.stats.split_batches == 1


def test_no_pool_wait_loses_the_end_of_the_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pool.wait = inf: must be a finite number"):
        load_config(None, ["pool.wait=inf"])
    sink = DiskSink(tmp_path / "observations")
    start = time.monotonic()
    FanOut([sink]).close(timeout=1e300)  # beyond what a thread's join takes
    assert time.monotonic() - start < 5


class BrokenSink:
    """A sink whose closing fails, as a full disk or a crashed writer would."""

    def submit(self, obs: object) -> None:
        pass

    def close(self, timeout: float | None = None) -> None:
        raise OSError("no space left on device")


def test_a_failing_step_of_the_runs_end_does_not_skip_the_status_or_the_report(tmp_path: Path, capsys) -> None:
    config = load_config(None, [f"out-dir={tmp_path / 'run'}", "pool.wait=1e300"])
    folder = Path(config.run.out_dir)
    folder.mkdir()
    recorder = RoundRecorder(folder / ROUNDS_FILE, config.train.rounds, config.train.clients_per_round)
    recorder.record(0, 2.3, 0.1)
    finish_run(
        folder, config, recorder, ("completed", ""), FanOut([BrokenSink()]), None, StopRequest(), Trackers([], folder)
    )

    assert "closing the capture failed: OSError: no space left on device" in capsys.readouterr().out
    assert read_json(folder / STATUS_FILE)["status"] == "completed"
    assert (folder / "report.html").is_file()


def test_the_report_shows_each_status_with_its_colour_and_the_runs_ending(tmp_path: Path) -> None:
    folder = make_run(tmp_path, batch=1, clients=1)
    [obs] = load_observations(folder / OBSERVATIONS_DIR)
    evaluator = Evaluator(folder, CONTEXTS)
    for status in ("interrupted", "score-error", "timeout", "error"):
        evaluator(AttackOutcome(obs, status, error=f"why {status}", attack="ig"))
    (folder / STATUS_FILE).write_text('{"status": "interrupted", "rounds": 0, "error": "stopped by SIGINT"}')
    page = build_report(folder).read_text()

    assert '<span class="badge timeout">interrupted</span>' in page
    assert '<span class="badge error">score-error</span>' in page
    assert '<span class="badge timeout">timeout</span>' in page and '<span class="badge error">error</span>' in page
    assert "4 not ok (1 error, 1 interrupted, 1 score-error, 1 timeout)" in page
    assert "Run status: interrupted after 0 rounds (stopped by SIGINT)." in page


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    with attacker_ray_cluster():
        yield


def fake_pool(outcomes: Outcomes, **options) -> AttackPool:
    defaults = {"workers": 1, "time_limit": 60.0, "group": 4, "poll_seconds": 0.05}
    return AttackPool([AttackSpec("fake", functools.partial(FakeAttack))], outcomes, **{**defaults, **options})


@pytest.mark.slow
def test_a_batch_that_raises_is_run_again_one_upload_at_a_time(ray_cluster) -> None:
    outcomes = Outcomes()
    pool = fake_pool(outcomes)
    blocker = observation(9, "sleep", seconds=2.0, batch_size=3)  # keeps the worker busy while the rest queues
    batch = [observation(0), observation(1, "raise"), observation(2)]
    for obs in [blocker, *batch]:
        pool.submit(obs)
    outcomes.wait(4)
    pool.close(timeout=10)

    assert [o.status for o in outcomes.of(batch[1])] == ["error"] and ERROR_TEXT in outcomes.of(batch[1])[0].error
    for obs in (batch[0], batch[2]):
        [outcome] = outcomes.of(obs)
        assert outcome.status == "ok" and outcome.reconstruction.stats["call"] == (obs.client,)
    assert pool.stats.split_batches == 1 and len(outcomes.items) == 4


@pytest.mark.slow
def test_a_stopping_run_records_queued_and_running_attacks_as_interrupted_at_once(ray_cluster) -> None:
    outcomes = Outcomes()
    reason: list[str] = []
    pool = fake_pool(outcomes, group=1, stop=lambda: reason[0] if reason else None)
    done = observation(0)
    pool.submit(done)
    outcomes.wait(1)
    left = [observation(1, "hang"), observation(2, "hang")]  # one running, one queued
    for obs in left:
        pool.submit(obs)
    time.sleep(1.0)
    reason.append("stopped by SIGINT")
    start = time.monotonic()
    pool.close(timeout=600)

    assert time.monotonic() - start < 5, "a stopping run must not wait for its attacks"
    assert outcomes.of(done)[0].status == "ok"
    for obs in left:
        [outcome] = outcomes.of(obs)
        assert outcome.status == "interrupted" and "stopped by SIGINT" in outcome.error
    assert pool.stats.interrupted == 2 and pool.pending() == 0
