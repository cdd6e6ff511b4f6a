"""The privacy object of a sweep row: images pooled over seeds and clients, the best attack per round, the
worst round for the client."""

from __future__ import annotations

import numpy as np
import pytest

from fedguard.report.leakage import privacy
from fedguard.report.leakage_table import leakage_tables
from fedguard.report.statistics import bootstrap_ci


def row(attack: str, round_: int, seed: int, ssims: list[float], lpips: bool = True) -> dict:
    """A scored ``attacks.jsonl`` row with one image per SSIM in ``ssims``."""
    images = [{"psnr": 30 * s, "ssim": s, "lpips": 1 - s if lpips else None} for s in ssims]
    return {"attack": attack, "status": "ok", "round": round_, "client": 0, "seed": seed, "per_image": images}


def test_the_headline_is_the_best_attack_of_the_worst_round_with_every_round_listed() -> None:
    rows = [
        row("ig", 1, 0, [0.2, 0.3]),
        row("ig", 1, 1, [0.4]),
        row("idlg", 1, 0, [0.1, 0.1, 0.1]),
        row("ig", 5, 0, [0.9, 0.7]),
        row("ig", 5, 1, [0.8, 0.6]),
        row("idlg", 5, 0, [0.95, 0.2], lpips=False),
    ]
    leak = privacy(rows, {"ig": True, "idlg": False})
    assert [(r["round"], r["attack"], r["n_images"]) for r in leak["per_round"]] == [(1, "ig", 3), (5, "ig", 4)]
    assert (leak["attack"], leak["adaptive"], leak["round"], leak["seeds"]) == ("ig", True, 5, [0, 1])
    pooled = np.array([0.9, 0.7, 0.8, 0.6])
    assert leak["ssim_mean"] == pytest.approx(0.75) and leak["ssim_median"] == pytest.approx(0.75)
    assert leak["ssim_ci95"] == bootstrap_ci(pooled) and leak["lpips_ci95"] == bootstrap_ci(1 - pooled)
    assert leak["psnr_mean"] == pytest.approx(22.5) and leak["success_rate"] == 1.0 and leak["recovered_rate"] == 0.0
    assert leak["missing"] == {"psnr": 0, "ssim": 0, "lpips": 0}


def test_on_a_tie_the_attack_that_knows_the_defense_is_the_rounds_best() -> None:
    for order in (["ig", "ig-adaptive"], ["ig-adaptive", "ig"]):
        leak = privacy([row(name, 1, 0, [0.9, 0.5]) for name in order], {"ig": False, "ig-adaptive": True})
        assert (leak["attack"], leak["adaptive"]) == ("ig-adaptive", True), order


def test_images_without_a_score_are_left_out_and_counted() -> None:
    leak = privacy([row("idlg", 1, 0, [0.95, 0.2], lpips=False), row("idlg", 1, 2, [0.6])], {})
    assert leak["n_images"] == 3 and leak["seeds"] == [0, 2] and leak["adaptive"] is False
    assert (
        leak["missing"]["lpips"] == 2 and leak["lpips_mean"] == pytest.approx(0.4) and leak["lpips_ci95"] == [0.4] * 2
    )
    assert leak["success_rate"] == pytest.approx(2 / 3) and leak["recovered_rate"] == pytest.approx(1 / 3)


def test_nothing_scored_is_no_privacy_object() -> None:
    assert privacy([], {}) is None
    assert privacy([{"attack": "ig", "status": "ok", "round": 1, "per_image": []}], {}) is None


def test_the_leakage_table_has_a_line_per_variant_and_attack_and_bolds_each_rounds_best() -> None:
    rows = [
        row("ig", 1, 0, [0.2, 0.3]),
        row("idlg", 1, 0, [0.1, 0.1]),
        row("ig", 5, 0, [0.9, 0.7]),
        row("idlg", 5, 0, [0.95, 0.85]),
    ]
    cells = [
        {"setting": "trained", "variant": "none", "privacy": privacy(rows, {"ig": True})},
        {"setting": "trained", "variant": "dp", "privacy": privacy(rows[:2], {"ig": True})},
        {"setting": "privacy-only", "variant": "none", "privacy": None},
    ]
    table = leakage_tables(cells).splitlines()
    assert table[0].startswith("Mean SSIM [95% CI] per attack and attacked round, setting `trained`, 2 images a cell")
    assert table[2] == "| variant | attack | round 1 | round 5 |"
    low, high = bootstrap_ci(np.array([0.2, 0.3]))
    assert table[4] == f"| `none` | `ig` (adaptive) | **0.25 [{low:.2f}, {high:.2f}]** | 0.80 [0.70, 0.90] |"
    assert table[5].startswith("| `none` | `idlg` | 0.10 [0.10, 0.10] | **0.90 [")
    assert table[6].endswith("| - |") and table[6].startswith("| `dp` | `ig` (adaptive) | **0.25")
    assert len(table) == 8 and "privacy-only" not in "\n".join(table)
    assert leakage_tables(cells[2:]) == ""
