"""The round log: rows on disk as rounds end, progress with time left, a summary."""

from __future__ import annotations

import io
import json
from pathlib import Path

from fedguard.report.rounds import RoundRecorder


def test_rows_are_on_disk_before_close_and_progress_estimates_time(tmp_path: Path) -> None:
    out = io.StringIO()
    recorder = RoundRecorder(tmp_path / "rounds.jsonl", total_rounds=4, clients_per_round=3, out=out)
    recorder.record(0, 2.3, 0.1)
    recorder.record(1, 2.0, 0.3)
    recorder.record(2, 1.5, 0.6)
    rows = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2] and rows[2]["accuracy"] == 0.6
    assert all(r["seconds"] >= 0 for r in rows)
    lines = out.getvalue().splitlines()
    assert "initial model" in lines[0] and "left" not in lines[1]
    assert "3 clients" in lines[2] and "s left" in lines[2] and " 60.0%" in lines[2]
    summary = recorder.summary()
    assert "2 of 4 rounds" in summary and "10.0% -> 60.0%" in summary and "round 2" in summary
    recorder.close()


def test_summary_without_rounds(tmp_path: Path) -> None:
    recorder = RoundRecorder(tmp_path / "r.jsonl", 3, 1, out=io.StringIO())
    assert recorder.summary() == "no round finished"
    recorder.close()


def test_progress_shows_what_the_defense_reports(tmp_path: Path) -> None:
    out = io.StringIO()
    recorder = RoundRecorder(tmp_path / "rounds.jsonl", total_rounds=2, clients_per_round=3, out=out)
    recorder.record(1, 2.0, 0.3, defense={"epsilon": 1.23456})
    recorder.close()
    assert "| epsilon 1.235" in out.getvalue()
    assert json.loads((tmp_path / "rounds.jsonl").read_text())["defense"] == {"epsilon": 1.23456}
