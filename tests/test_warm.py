"""The warm runtime (``fedguard.runtime.warm``): runs one after another in one runner on one Ray cluster compute
what cold runs compute, and a run that overstays its time limit or loses its runner ends as a cold one would."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

import fedguard
from fedguard.api import _WARM
from fedguard.config import load_config
from fedguard.report.run_status import read_status
from fedguard.runtime.warm import WarmRuntime
from fedguard.store.folder import REPORT_FILE
from fedguard.store.rows import read_attacks, read_rounds
from tests.test_sweep import IDLG_ROUND_1
from tests.test_sweep import SMALL as SWEEP_SMALL

pytestmark = pytest.mark.slow  # Ray, Flower's simulation engine

SMALL = SWEEP_SMALL.replace('name = "small"', 'name = "warm"') + IDLG_ROUND_1


def computed(folder: Path) -> tuple[object, ...]:
    """What a run computed: accuracy and loss per round, the attack's scores per upload."""
    rounds = [(r["round"], r["accuracy"], r["loss"]) for r in read_rounds(folder)]
    attacks = sorted((a["attack"], a["round"], a["client"], a["ssim"], a["psnr"]) for a in read_attacks(folder))
    return rounds, attacks


def test_warm_runs_compute_what_a_cold_run_does_in_one_runner_until_close(tmp_path: Path) -> None:
    preset = tmp_path / "warm.toml"
    preset.write_text(SMALL)
    cold = fedguard.run(preset, out=tmp_path / "cold", progress=None)
    lines: list[str] = []
    first = fedguard.run(preset, out=tmp_path / "warm-1", progress=lines.append, warm=True)
    runner = _WARM["runtime"].runner
    assert runner is not None
    second = fedguard.run(preset, out=tmp_path / "warm-2", progress=None, warm=True)
    assert _WARM["runtime"].runner is runner, "the second warm run ran in the first one's runner"
    fedguard.close()
    assert runner.poll() is not None and "runtime" not in _WARM
    assert len(read_rounds(cold.folder)) == 3 and len(read_attacks(cold.folder)) == 1
    assert computed(first.folder) == computed(cold.folder) == computed(second.folder)
    assert first.status is not None and first.status["status"] == "completed"
    assert (first.folder / REPORT_FILE).is_file()
    assert any(line.startswith("round 2/2") for line in lines), lines  # its progress, as `fedguard run` prints it
    assert not any("INFO" in line for line in lines), "Flower's own INFO lines are left out, as `fedguard run` does"


def test_a_warm_run_past_its_limit_stops_cleanly_and_a_killed_runner_is_replaced(tmp_path: Path) -> None:
    (tmp_path / "long.toml").write_text(SMALL.replace("rounds = 2", "rounds = 5000"))
    (tmp_path / "short.toml").write_text(SMALL)
    long_run, short_run = load_config(tmp_path / "long.toml"), load_config(tmp_path / "short.toml")
    with WarmRuntime(2) as runtime:
        code = runtime.run(long_run, tmp_path / "timed-out", tmp_path / "timed-out.log", timeout=20)
        assert code == -1
        status = read_status(tmp_path / "timed-out")
        assert status is not None and status["status"] == "interrupted", status
        assert (tmp_path / "timed-out" / REPORT_FILE).is_file(), "the stopped run still wrote its report"
        assert runtime.runner is not None, "a run that stopped in time keeps its runner"

        killed = tmp_path / "killed"
        deadline = time.monotonic() + 120

        def kill_once_training(line: str) -> None:
            if re.match(r"round +2/", line) and runtime.runner is not None:
                os.kill(runtime.runner.pid, signal.SIGKILL)

        code = runtime.run(long_run, killed, tmp_path / "killed.log", timeout=120, progress=kill_once_training)
        assert code == -signal.SIGKILL and runtime.runner is None
        while read_status(killed) is None and time.monotonic() < deadline:
            time.sleep(0.2)  # the watcher records the ending
        status = read_status(killed)
        assert status is not None and status["status"] == "interrupted", status
        assert "ended without stopping the run" in status["error"]

        assert runtime.run(short_run, tmp_path / "after", tmp_path / "after.log", timeout=180) == 0
        assert json.loads((tmp_path / "after" / "status.json").read_text())["status"] == "completed"


def test_a_warm_sweep_runs_in_the_processs_runtime_and_leaves_it_to_the_next_run(tmp_path: Path) -> None:
    preset = tmp_path / "sweep.toml"
    variants = '\n[sweep.variants.none]\n"defense.name" = "none"\n[sweep.variants.prune]\n"defense.name" = "prune"\n'
    preset.write_text(SMALL + variants)
    lines: list[str] = []
    sweep = fedguard.run_sweep(preset, out=tmp_path / "sweep", progress=lines.append, warm=True)
    runner = _WARM["runtime"].runner
    assert runner is not None
    assert list(sweep.runs["status"]) == ["ok", "ok"], lines
    assert lines[0] == f"fedguard: sweep warm: 2 runs in {tmp_path / 'sweep'}"
    assert any(": ok;" in line for line in lines), lines
    plain = tmp_path / "plain.toml"
    plain.write_text(SMALL)
    fedguard.run(plain, out=tmp_path / "after", progress=None, warm=True)
    assert _WARM["runtime"].runner is runner, "the run after the sweep ran in the sweep's runner"
    fedguard.close()
