"""A real Flower simulation on Ray: clients train, accuracy rises, the server captures uploads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fedguard.config import load_config
from fedguard.observation import load_observations
from fedguard.server_app import initial_model
from fedguard.training import get_arrays

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_simulation_trains_and_captures(tmp_path: Path) -> None:
    out = tmp_path / "run"
    overrides = ["train.rounds=12", "partition.num-clients=6", "train.clients-per-round=4", "capture.rounds=1,2",
                 "capture.clients=0-2"]
    command = [sys.executable, "-m", "fedguard", "run", str(ROOT / "experiments" / "quickstart.toml"), "--out", str(out)]
    for override in overrides:
        command += ["--set", override]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "round 12/12" in result.stdout and "left" in result.stdout

    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(13))
    assert all({"round", "accuracy", "loss", "seconds"} <= r.keys() for r in rows)
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.3, rows
    assert rows[-1]["loss"] < rows[0]["loss"]

    observations = load_observations(out / "observations")
    assert observations, "no upload captured"
    assert {o.round for o in observations} <= {1, 2} and {o.client for o in observations} <= {0, 1, 2}
    assert len([o for o in observations if o.round == 1]) == len({o.client for o in observations if o.round == 1})
    config = load_config(out / "config.toml")
    start = get_arrays(initial_model(config))
    for obs in (o for o in observations if o.round == 1):
        assert obs.kind == "gradient" and obs.declared["batch-size"] == 32
        assert all(np.array_equal(a, b) for a, b in zip(obs.global_arrays, start))
        assert any(np.abs(u).sum() > 0 for u in obs.upload)
