"""The detection table (``fedguard.report.detection``) from hand-made ``rounds.jsonl`` and ``attacks.jsonl`` rows:
which client-rounds are malicious, the rates per detector and their Wilson intervals, the recovered images per
manipulation and round, and the table a sweep folder gives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fedguard.report.detection import (
    ANY,
    HONEST,
    client_rounds,
    detection_table,
    detector_rows,
    manipulation_rows,
    pooled_findings,
    setting_rows,
    sweep_runs,
)
from fedguard.report.statistics import wilson_interval


def finding(client: int, structure: bool, drift: bool) -> dict[str, Any]:
    """A client's ``detect`` entry with the two detectors' flags."""
    return {
        "client": client,
        "structure.repeated-rows": 1.0,
        "structure.flagged": float(structure),
        "drift.drift": 0.1,
        "drift.flagged": float(drift),
        "flagged": float(structure or drift),
        "action": "report" if structure or drift else "none",
    }


# Round 1: imprint, first round (structure flags both clients, drift neither); round 2 honest (drift raises a
# false alarm for client 1); round 3: imprint (both flag client 0, only drift client 1); round 0: no detect.
ROUNDS: list[dict[str, Any]] = [
    {"round": 0, "accuracy": 0.1},
    {"round": 1, "detect": [finding(0, True, False), finding(1, True, False)]},
    {"round": 2, "detect": [finding(0, False, False), finding(1, False, True)]},
    {"round": 3, "detect": [finding(0, True, True), finding(1, False, True)]},
]
SCHEDULE = {1: "imprint", 3: "imprint"}
ATTACKS: list[dict[str, Any]] = [
    {"round": 1, "manipulation": "imprint", "status": "ok", "per_image": [{"ssim": 0.95}, {"ssim": 0.5}]},
    {"round": 1, "manipulation": "imprint", "status": "ok", "per_image": [{"ssim": 0.99}, {"ssim": 0.91}]},
    {"round": 1, "manipulation": "imprint", "status": "failed", "per_image": [{"ssim": 1.0}]},
    {"round": 3, "manipulation": "imprint", "status": "ok", "per_image": [{"ssim": 0.2}, {"ssim": None}]},
]


def test_wilson_interval_matches_known_values_and_refuses_bad_counts() -> None:
    assert wilson_interval(5, 10) == pytest.approx([0.2366, 0.7634], abs=1e-4)
    assert wilson_interval(0, 10) == pytest.approx([0.0, 0.2775], abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx([0.7225, 1.0], abs=1e-4)
    with pytest.raises(ValueError, match="3 of 2"):
        wilson_interval(3, 2)
    with pytest.raises(ValueError, match="0 of 0"):
        wilson_interval(0, 0)


def test_client_rounds_are_malicious_where_the_schedule_says() -> None:
    found = client_rounds(ROUNDS, SCHEDULE)
    assert [(c.manipulation, c.round, c.client) for c in found] == [
        ("imprint", 1, 0),
        ("imprint", 1, 1),
        (HONEST, 2, 0),
        (HONEST, 2, 1),
        ("imprint", 3, 0),
        ("imprint", 3, 1),
    ]
    assert found[-1].flags == {"structure": False, "drift": True}


def test_rates_per_detector_and_their_union() -> None:
    rows = {r.detector: r for r in detector_rows(client_rounds(ROUNDS, SCHEDULE))}
    assert list(rows) == ["structure", "drift", ANY]
    assert (rows["structure"].detected.k, rows["structure"].detected.n) == (3, 4)
    assert (rows["drift"].detected.k, rows["drift"].false_alarms.k, rows["drift"].false_alarms.n) == (2, 1, 2)
    assert (rows[ANY].detected.k, rows[ANY].false_alarms.k) == (4, 1)
    assert rows["structure"].false_alarms.k == 0
    assert rows["structure"].detected.ci95 == wilson_interval(3, 4)


def test_per_manipulation_and_round_beside_the_recovered_images() -> None:
    rows = manipulation_rows(client_rounds(ROUNDS, SCHEDULE), ATTACKS)
    assert [(m.manipulation, m.round, m.client_rounds) for m in rows] == [("imprint", 1, 2), ("imprint", 3, 2)]
    first, later = rows
    assert (first.flagged["structure"].k, first.flagged["drift"].k, first.flagged[ANY].k) == (2, 0, 2)
    assert (first.recovered.k, first.recovered.n) == (3, 4)  # the failed row is not counted
    assert (later.flagged["drift"].k, later.recovered.k, later.recovered.n) == (2, 0, 1)  # None: not scored


def write_run(folder: Path, malicious: str, attacks: list[dict[str, Any]]) -> None:
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(f'[threat]\nmalicious = "{malicious}"\n')
    (folder / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROUNDS))
    (folder / "attacks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in attacks))


def write_sweep_runs(folder: Path) -> None:
    """A sweep folder of two runs with detectors, settings 'sgd' (run a: rounds 1 and 3 imprint) and 'avg' (run
    b: round 2), a failed run and one without detectors."""
    write_run(folder / "a", "1:imprint, 3:imprint", ATTACKS)
    write_run(folder / "b", "2:imprint", [])
    rows = [
        {"setting": "sgd", "status": "ok", "folder": str(folder / "a")},
        {"setting": "avg", "status": "ok", "folder": str(folder / "b")},
        {"setting": "avg", "status": "failed", "folder": str(folder / "c")},
    ]
    (folder / "d").mkdir()  # a run without detectors (and here without config.toml): read no further
    (folder / "d" / "rounds.jsonl").write_text(json.dumps({"round": 1, "accuracy": 0.5}) + "\n")
    rows.append({"setting": "avg", "status": "ok", "folder": str(folder / "d")})
    (folder / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_table_of_a_sweep_folder(tmp_path: Path) -> None:
    write_sweep_runs(tmp_path)
    table = detection_table(*pooled_findings(sweep_runs(tmp_path)))
    print(table)
    # a: 4 malicious (structure flags 3), 2 honest (0); b: 2 malicious in round 2 (0), 4 honest (3)
    assert "| structure | 3 of 6 (50%) | [19, 81]% | 3 of 6 (50%) | [19, 81]% |" in table
    assert "| imprint | 1 | 2 of 2 (100%) | 0 of 2 (0%) | 2 of 2 (100%) | 3 of 4 (75%) |" in table
    assert "| any | 5 of 6 (83%) |" in table
    assert "| imprint | 2 | 0 of 2 (0%) | 1 of 2 (50%) | 1 of 2 (50%) | - |" in table
    assert detection_table([], []) == ""
    with pytest.raises(FileNotFoundError, match="runs.jsonl not found"):
        sweep_runs(tmp_path / "a")


def test_rates_per_setting(tmp_path: Path) -> None:
    write_sweep_runs(tmp_path)
    found, attacks = pooled_findings(sweep_runs(tmp_path))
    per_setting = setting_rows(found)
    assert list(per_setting) == ["sgd", "avg"]
    avg = {r.detector: r for r in per_setting["avg"]}
    assert (avg["structure"].detected.k, avg["structure"].detected.n) == (0, 2)
    assert (avg["structure"].false_alarms.k, avg["structure"].false_alarms.n) == (3, 4)
    assert (avg["drift"].detected.k, avg["drift"].false_alarms.k, avg[ANY].false_alarms.k) == (1, 2, 4)
    table = detection_table(found, attacks)
    assert "| sgd | structure | 3 of 4 (75%) | [30, 95]% | 0 of 2 (0%) | [0, 66]% |" in table
    assert "| avg | any | 1 of 2 (50%) | [9, 91]% | 4 of 4 (100%) | [51, 100]% |" in table
    assert table.index("Per setting:") < table.index("| manipulation |")
    one_setting = [c for c in found if c.setting == "sgd"]
    assert list(setting_rows(one_setting)) == ["sgd"] and "Per setting" not in detection_table(one_setting, [])
