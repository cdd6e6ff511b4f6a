"""Resuming a run (``fedguard run --resume``): the rounds after the checkpoint equal one uninterrupted run's.

In process: ``run_server`` on a ``LocalGrid`` whose clients keep their state in files under the run folder,
as simulated clients do; a run stopped inside a round (some clients of it already trained, captured and kept
state) is resumed on a fresh grid, as a new simulation would be. The client state store, the checkpoint file
and the rewind of a run folder are tested on their own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from fedguard.config import Config
from fedguard.defenses.base import LocalStep
from fedguard.defenses.dgp import DGPParams, DualGradientPruning
from fedguard.report.run_status import read_status
from fedguard.runtime.client_app import make_client_app
from fedguard.runtime.server_app import run_server
from fedguard.runtime.stopping import RunInterrupted
from fedguard.store.checkpoint import CheckpointError, RoundCheckpoint, read_checkpoint, write_checkpoint
from fedguard.store.client_state import FileState, discard_after
from fedguard.store.folder import read_jsonl
from fedguard.store.resume import resume_point, rewind
from strategies.state import restore_strategy_state, strategy_state
from tests.commands import SMALL_RUN, settings
from tests.helpers import config
from tests.local_grid import LocalGrid
from tests.test_clean_stop import TAG, kill_all, wait_for_rounds

ROOT = Path(__file__).resolve().parents[1]


def run_config(folder: Path, *overrides: str) -> Config:
    """FedSGD with DGP (error feedback: state in every client) and FedAdam (state in the server), 3 of 4 clients
    sampled per round, the uploads of clients 0 and 1 captured in every round."""
    return config(
        "defense.name=dgp",
        "server.strategy=fedadam",
        "train.rounds=4",
        "capture.rounds=all",
        "capture.clients=0,1",
        f"out-dir={folder}",
        *overrides,
    )


class StoppingGrid(LocalGrid):
    """A ``LocalGrid`` stopped in round ``stop_round`` after ``after`` of its clients ran, as a signal would."""

    def __init__(self, *args, stop_round: int, after: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stop_round, self.after, self.rounds = stop_round, after, 0

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        if not messages:
            return []
        self.rounds += 1
        if self.rounds == self.stop_round:
            super().send_and_receive(messages[: self.after])
            raise RunInterrupted("stopped by SIGTERM")
        return super().send_and_receive(messages)


def rows_without_time(folder: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in ("seconds", "at")} for row in read_jsonl(folder / "rounds.jsonl")]


@pytest.fixture
def as_simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients keep state and ground truth under the run folder, as on Flower's simulation engine."""
    monkeypatch.setattr("fedguard.runtime.client_app.in_simulation", lambda: True)


def run(cfg: Config, grid_type=LocalGrid, **kwargs) -> Path:
    grid = grid_type(make_client_app(cfg), cfg.partition.num_clients, **kwargs)
    try:
        return run_server(grid, cfg)
    except RunInterrupted:
        return Path(cfg.run.out_dir)


def test_a_run_stopped_inside_a_round_and_resumed_equals_an_uninterrupted_one(tmp_path: Path, as_simulated) -> None:
    whole = run(run_config(tmp_path / "whole"))
    stopped = run(run_config(tmp_path / "stopped"), StoppingGrid, stop_round=3, after=2)
    assert read_status(stopped)["status"] == "interrupted"
    assert read_checkpoint(stopped).round == 2
    # Round 3's first two clients trained and kept state before the stop.
    assert list((stopped / "client-state").glob("client-*/round-0003.npz"))
    resumed = run(run_config(stopped, "resume=true"))
    assert read_status(resumed)["status"] == "completed"
    assert rows_without_time(resumed) == rows_without_time(whole)
    assert [r["round"] for r in read_jsonl(resumed / "rounds.jsonl")] == [0, 1, 2, 3, 4]
    for sub in ("observations", "vault"):
        names = sorted(p.name for p in (whole / sub).iterdir())
        assert names == sorted(p.name for p in (resumed / sub).iterdir()) and len(names) >= 4
        for name in names:
            with np.load(whole / sub / name) as a, np.load(resumed / sub / name) as b:
                assert a.files == b.files and all(np.array_equal(a[k], b[k]) for k in a.files), name
    np.testing.assert_array_equal(read_checkpoint(whole).arrays[0], read_checkpoint(resumed).arrays[0])


def test_resume_goes_on_to_more_rounds_and_refuses_a_finished_run(tmp_path: Path, as_simulated) -> None:
    whole = run(run_config(tmp_path / "whole"))
    short = run(run_config(tmp_path / "short", "train.rounds=2"))
    with pytest.raises(ValueError, match="completed all 2 rounds"):
        resume_point(short, 2)
    longer = run(run_config(short, "resume=true", "train.rounds=4"))
    assert rows_without_time(longer) == rows_without_time(whole)
    assert (
        "rounds = 4" in (longer / "config.toml").read_text()
        and "resume = true" not in (longer / "config.toml").read_text()
    )


def test_the_seeded_sampling_picks_the_same_clients_whatever_the_node_ids(tmp_path: Path) -> None:
    """Flower's simulation numbers its nodes at random: the clients sampled depend on the seed and round only."""

    class OtherIds(LocalGrid):
        def get_node_ids(self):
            return [7_000_000 - 1000 * i for i in range(self.num_nodes)]  # the order differs too

    first = run(run_config(tmp_path / "a", "capture.rounds=none"))
    second = run(run_config(tmp_path / "b", "capture.rounds=none"), OtherIds)
    assert rows_without_time(first) == rows_without_time(second)


def test_file_state_keeps_the_dgp_residual_bit_for_bit_and_one_version_back(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    dgp = DualGradientPruning(DGPParams())
    store = FileState(tmp_path, client=5)
    in_memory: dict[str, torch.Tensor] = {}
    for round_ in (1, 2, 3):
        grads = [torch.randn(3, 6), torch.randn(3)]
        step = LocalStep(
            model, torch.zeros(1, 6), torch.zeros(1, dtype=torch.long), grads, None, torch.Generator(), round_, 5, 10
        )
        state = store.load(round_)
        assert state.keys() == in_memory.keys()
        assert all(torch.equal(state[k], in_memory[k]) for k in state)
        before = {k: v.clone() for k, v in state.items()}
        sent = dgp(step, state)
        for i, (g, s) in enumerate(zip(grads, sent)):  # error feedback conserves P = g + e exactly
            key = f"dgp.residual.{i}"
            total = g + before.get(key, torch.zeros_like(g))
            assert torch.equal(s + state[key], total)
        store.store(round_, state)
        in_memory = {k: v.clone() for k, v in state.items()}
    files = sorted(p.name for p in (tmp_path / "client-0005").iterdir())
    assert files == ["round-0002.npz", "round-0003.npz"]  # the version read is kept until a newer round is read
    assert FileState(tmp_path, 5).load(3).keys() == in_memory.keys()  # round 3 again reads round 2's
    assert discard_after(tmp_path, 2) == 1
    assert sorted(p.name for p in (tmp_path / "client-0005").iterdir()) == ["round-0002.npz"]


def test_file_state_of_a_stateless_defense_writes_nothing(tmp_path: Path) -> None:
    store = FileState(tmp_path, client=0)
    assert store.load(1) == {}
    store.store(1, {})
    assert not (tmp_path / "client-0000").exists()


def test_an_unreadable_client_state_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "client-0002").mkdir()
    (tmp_path / "client-0002" / "round-0001.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="round-0001.npz cannot be read"):
        FileState(tmp_path, 2).load(2)


def test_checkpoint_round_trip_and_refusals(tmp_path: Path) -> None:
    point = RoundCheckpoint(
        3, ("w", "b"), [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(2)], {"4/m_t/d/w": np.full((2, 3), 0.5)}
    )
    write_checkpoint(tmp_path, point)
    back = read_checkpoint(tmp_path)
    assert back.round == 3 and back.names == ("w", "b") and back.strategy.keys() == point.strategy.keys()
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(back.arrays, point.arrays))
    (tmp_path / "checkpoint.npz").write_bytes(b"torn")
    with pytest.raises(CheckpointError, match="checkpoint.npz cannot be read"):
        read_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "elsewhere")


def test_strategy_state_round_trip_through_wrappers() -> None:
    from flwr.serverapp.strategy import FedAdam, FedAvgM

    from strategies.wrapper import StrategyWrapper

    adam = FedAdam()
    adam.m_t = {"w": np.ones((2, 2)), "b": np.zeros(2)}
    adam.v_t = {"w": np.full((2, 2), 2.0), "b": np.ones(2)}
    state = strategy_state(StrategyWrapper(adam))
    fresh = FedAdam()
    restore_strategy_state(StrategyWrapper(fresh), state)
    assert fresh.m_t.keys() == adam.m_t.keys() and all(np.array_equal(fresh.v_t[k], adam.v_t[k]) for k in adam.v_t)
    momentum = FedAvgM(server_momentum=0.9)
    momentum.momentum_vector = [np.ones(3), np.zeros((2, 2))]
    other = FedAvgM(server_momentum=0.9)
    restore_strategy_state(other, strategy_state(momentum))
    assert len(other.momentum_vector) == 2 and np.array_equal(other.momentum_vector[1], np.zeros((2, 2)))
    with pytest.raises(ValueError, match="another server.strategy"):
        restore_strategy_state(FedAvgM(), {"0/m_t/d/w": np.ones(2)})


def test_a_strategy_that_declares_its_own_state_gets_it_back_and_one_that_does_not_is_named() -> None:
    from flwr.serverapp.strategy import FedAvg

    from strategies.wrapper import StrategyWrapper

    class Counting(FedAvg):
        """A strategy of one's own, with a state of its own."""

        def __init__(self) -> None:
            super().__init__()
            self.seen = np.zeros(3)

        def state_arrays(self) -> dict[str, np.ndarray]:
            return {"seen": self.seen}

        def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
            self.seen = arrays["seen"]

    counting = Counting()
    counting.seen = np.array([1.0, 2.0, 3.0])
    state = strategy_state(StrategyWrapper(counting))
    assert list(state) == ["1/own/seen"]
    fresh = Counting()
    restore_strategy_state(StrategyWrapper(fresh), state)
    assert np.array_equal(fresh.seen, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="FedAvg, which has no state_arrays"):
        restore_strategy_state(StrategyWrapper(FedAvg()), state)


def test_rewind_removes_what_an_unfinished_round_left(tmp_path: Path) -> None:
    (tmp_path / "rounds.jsonl").write_text("".join(json.dumps({"round": r}) + "\n" for r in range(4)) + '{"rou')
    (tmp_path / "attacks.jsonl").write_text(json.dumps({"round": 2}) + "\n" + json.dumps({"round": 3}) + "\n")
    for sub in ("observations", "vault", "images"):
        (tmp_path / sub).mkdir()
        for round_ in (2, 3):
            (tmp_path / sub / f"round-{round_:04d}_client-0001{'_ig_truth.png' if sub == 'images' else '.npz'}").touch()
    FileState(tmp_path / "client-state", 1).store(3, {"x": torch.ones(1)})
    with pytest.warns(UserWarning, match="torn"):
        removed = rewind(tmp_path, 2)
    assert removed == {
        "round rows": 1,
        "attack rows": 1,
        "uploads": 1,
        "true batches": 1,
        "images": 1,
        "client states": 1,
    }
    assert [r["round"] for r in read_jsonl(tmp_path / "rounds.jsonl")] == [0, 1, 2]
    assert (tmp_path / "rounds.jsonl").read_text().endswith("\n")


def test_cli_resume_refuses_changes_to_what_the_rounds_compute(tmp_path: Path) -> None:
    def fedguard(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fedguard", *args], capture_output=True, text=True, cwd=ROOT)

    refused = fedguard("run", "--resume", str(tmp_path), "--set", "defense.name=dgp")
    assert refused.returncode == 2 and "defense.name=dgp would change what the rounds compute" in refused.stderr
    missing = fedguard("run", "--resume", str(tmp_path))
    assert missing.returncode == 2 and "no config.toml there" in missing.stderr


@pytest.mark.slow
@pytest.mark.heavy
def test_fedguard_run_stopped_by_sigterm_and_resumed_equals_an_uninterrupted_run(tmp_path: Path, as_simulated) -> None:
    """The real thing: a Flower simulation stopped after round 2 by SIGTERM, resumed by ``fedguard run --resume``,
    against the same rounds run without a stop (in process: the same server and clients, one grid)."""
    setting = [
        "defense.name=dgp",
        "server.strategy=fedadam",
        "train.rounds=6",
        "capture.rounds=all",
        "capture.clients=0,1",
    ]
    reference = run(config(*setting, f"out-dir={tmp_path / 'whole'}"))
    out, tag = tmp_path / "run", uuid.uuid4().hex
    command = [sys.executable, "-m", "fedguard", "run", "--out", str(out), *settings([*SMALL_RUN, *setting])]
    env = {**os.environ, TAG: tag}
    try:
        with open(tmp_path / "first.log", "w") as output:
            process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, cwd=ROOT)
        wait_for_rounds(out, 2, process)
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 128 + signal.SIGTERM
        assert read_status(out)["status"] == "interrupted"
        done = read_checkpoint(out).round
        assert 2 <= done < 6
        resumed = subprocess.run(
            [sys.executable, "-m", "fedguard", "run", "--resume", str(out)],
            env=env,
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        assert f"resuming after round {done} of 6" in resumed.stdout
    finally:
        kill_all(tag)
    assert read_status(out)["status"] == "completed"
    assert rows_without_time(out) == rows_without_time(reference)
    names = sorted(p.name for p in (reference / "observations").iterdir())
    assert names == sorted(p.name for p in (out / "observations").iterdir())
    for name in names:
        with np.load(reference / "observations" / name) as a, np.load(out / "observations" / name) as b:
            assert all(np.array_equal(a[k], b[k]) for k in a.files), name


def test_resume_true_without_the_flag_is_refused(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "fedguard", "run", "--set", "resume=true", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2 and "fedguard run --resume RUN_DIR" in done.stderr
