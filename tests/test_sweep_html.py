"""sweep.html: the privacy-utility points from the cells, the figures beside the page, summary.md's tables as
HTML, the detection panel, and the page rendered in headless Chromium with every figure decoded."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from attackers.base import AttackOutcome, Reconstruction
from fedguard.commands.cli import main
from fedguard.commands.sweep import summary_table
from fedguard.evaluation import Evaluator
from fedguard.report.detection import detection_table, pooled_findings, sweep_runs
from fedguard.report.html import build_report
from fedguard.report.leakage import privacy
from fedguard.report.leakage_table import leakage_tables
from fedguard.report.sweep_html import (
    DETECTION_FIGURE,
    SWEEP_PAGE,
    detection_png,
    leakage_per_round_png,
    markdown_html,
    privacy_utility_points,
    split_section,
)
from fedguard.store.observation_files import load_observations
from fedguard.store.vault import read_truth
from tests.test_detection_report import write_sweep_runs
from tests.test_evaluation import make_run
from tests.test_report_html import CHROMIUM, chromium, img_count


def attacked(ssims_by_round: dict[int, list[float]]) -> dict:
    rows = [
        {
            "attack": "ig",
            "status": "ok",
            "round": r,
            "client": 0,
            "seed": 0,
            "per_image": [{"psnr": 10 + 30 * s, "ssim": s, "lpips": 1 - s} for s in ssims],
        }
        for r, ssims in ssims_by_round.items()
    ]
    return privacy(rows, {"ig": False})


def cells() -> list[dict]:
    common = {
        "setting": "trained",
        "status": "ok",
        "rounds": 3,
        "seeds": [0, 1],
        "baseline": "none",
        "setting_kind": "diagnostic",
    }
    return [
        {
            **common,
            "variant": "none",
            "accuracy": 0.8,
            "accuracy_ci95": [0.7, 0.9],
            "accuracy_share": 1.0,
            "seconds_per_round": 0.3,
            "upload_share": 1.0,
            "privacy": attacked({1: [0.9, 1.0], 3: [0.6, 0.8]}),
        },
        {
            **common,
            "variant": "prune",
            "accuracy": 0.6,
            "accuracy_ci95": None,
            "accuracy_share": 0.75,
            "seconds_per_round": 0.5,
            "upload_share": 0.2,
            "privacy": attacked({1: [0.2, 0.4], 3: [0.1, 0.3]}),
        },
        {**common, "variant": "dp", "status": "failed", "error": "boom", "accuracy": None, "seeds": []},
    ]


def write_sweep(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = cells()
    (folder / "sweep.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "runs.jsonl").write_text("")
    (folder / "summary.md").write_text(
        summary_table(rows, "none") + "\n- `trained/dp` seed 0 **failed**: boom\n\n" + leakage_tables(rows)
    )
    return folder


def test_privacy_utility_points_are_the_headline_ssim_against_the_accuracy_kept() -> None:
    points = privacy_utility_points(cells(), "none")
    assert [p["variant"] for p in points] == ["none", "prune"], "a failed cell has no point"
    none, prune = points
    assert none["ssim"] == pytest.approx(0.95) and none["share"] == pytest.approx(100.0)
    assert none["share_errors"] == pytest.approx([12.5, 12.5]), "(0.8 - 0.7) / 0.8 of the baseline"
    assert prune["ssim"] == pytest.approx(0.3) and prune["share"] == pytest.approx(75.0)
    assert prune["share_errors"] == [0.0, 0.0], "one seed: no interval"
    low, high = cells()[1]["privacy"]["ssim_ci95"]
    assert prune["ssim_errors"] == pytest.approx([0.3 - low, high - 0.3])
    assert privacy_utility_points(cells()[1:], "none") == [], "no baseline accuracy, no share"


def test_cells_whose_images_have_no_ssim_draw_no_leakage() -> None:
    unscored = privacy([{"attack": "ig", "status": "ok", "round": 1, "client": 0, "per_image": [{}]}], {})
    cell = {**cells()[0], "privacy": unscored}
    assert leakage_per_round_png([cell]) is None and privacy_utility_points([cell], "none") == []


def test_summary_markdown_becomes_tables_lists_and_paragraphs() -> None:
    html = markdown_html("| a | b |\n|---|---:|\n| `x` | **1.0** |\n\n- `s/v` seed 0 **failed**: <oops>\n\nText `c`.\n")
    assert (
        '<thead><tr><th class="">a</th><th class="num">b</th></tr></thead>'
        '<tbody><tr><td class=""><code>x</code></td><td class="num"><b>1.0</b></td></tr></tbody>'
    ) in html
    assert "<ul><li><code>s/v</code> seed 0 <b>failed</b>: &lt;oops&gt;</li></ul>" in html
    assert html.endswith("<p>Text <code>c</code>.</p>")


def test_summary_sections_split_at_their_headings() -> None:
    markdown = "| a |\n\n## Detection\n\n| d |\n\n## The paper\n\n| p |\n"
    assert split_section(markdown, "Detection") == ("| a |\n\n## The paper\n\n| p |", "\n| d |\n")
    assert split_section("| a |\n", "Detection") == ("| a |\n", "")
    assert markdown_html("## Detection") == "<h3>Detection</h3>"


def test_the_sweep_page_shows_the_detection_rates_per_detector_and_setting(tmp_path: Path) -> None:
    folder = write_sweep(tmp_path / "sweep")
    write_sweep_runs(folder)
    found, attacks = pooled_findings(sweep_runs(folder))
    summary = folder / "summary.md"
    summary.write_text(summary.read_text() + "\n" + detection_table(found, attacks))
    assert main(["report", str(folder)]) == 0
    page = (folder / SWEEP_PAGE).read_text()
    panel = page[page.index("<h2>Detection</h2>") : page.index("<h2>Tables</h2>")]
    assert (folder / DETECTION_FIGURE).is_file() and img_count(page) == 4 and img_count(panel) == 1
    cells = '</td><td class="">'.join(["sgd", "structure", "3 of 4 (75%)", "[30, 95]%", "0 of 2 (0%)", "[0, 66]%"])
    assert cells in panel and '<td class="">any</td><td class="">5 of 6 (83%)' in panel
    assert page.count("flagged by structure") == 1, "the detection tables are in the panel, not again in Tables"
    assert "## " not in page and "Mean SSIM [95% CI] per attack" in page[page.index("<h2>Tables</h2>") :]
    assert detection_png([]) is None


def test_fedguard_report_on_a_sweep_folder_writes_the_page_and_its_figures(tmp_path: Path) -> None:
    folder = write_sweep(tmp_path / "sweep")
    assert main(["report", str(folder)]) == 0
    page = (folder / SWEEP_PAGE).read_text()
    assert sorted(p.name for p in folder.glob("*.png")) == [
        "cost-trained.png",
        "leakage-per-round-trained.png",
        "privacy-utility-trained.png",
    ]
    assert img_count(page) == 3 and page.count("data:image/png;base64,") == 3
    assert "Failed in every seed (no figure): dp" in page
    assert "Mean SSIM [95% CI] per attack and attacked round" in page and '<td class=""><code>prune</code></td>' in page
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//)""", page), "nothing loaded from outside"


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install chromium)")
def test_the_sweep_page_renders_in_chromium(tmp_path: Path) -> None:
    folder = write_sweep(tmp_path / "sweep")
    assert main(["report", str(folder)]) == 0
    url = (folder / SWEEP_PAGE).resolve().as_uri()
    dom = chromium(["--virtual-time-budget=5000", "--dump-dom", url], tmp_path / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    loaded = re.search(r'data-images-loaded="(\d+)"', dom.stdout)
    assert loaded and int(loaded.group(1)) == 3, "every figure decodes"
    shot = tmp_path / "shot.png"
    done = chromium(
        ["--window-size=1280,2400", "--hide-scrollbars", f"--screenshot={shot}", url], tmp_path / "profile-shot"
    )
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=np.float32)
    assert pixels.std() > 20, "the screenshot is not blank"


def test_each_variant_shows_its_best_rounds_reconstruction_and_links_every_runs_report(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    run = make_run(sweep / "trained" / "none", batch=3, clients=1)
    [obs] = load_observations(run / "observations")
    truth = read_truth(run / "vault", 1, 0)
    assert truth is not None
    evaluator = Evaluator(run, {"ig": {"attack": "ig", "defense": "none", "seed": 0, "invocation": "run"}})
    evaluator(AttackOutcome(obs, "ok", Reconstruction(*truth), attack="ig"))
    build_report(run)
    rows = cells()[:2]
    rows[0].update(strongest_attack="ig", by_round={"1": {"ssim": 1.0}})
    write_sweep(sweep)
    (sweep / "sweep.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    runs = [
        {"setting": "trained", "variant": "none", "seed": 0, "status": "ok", "folder": str(run)},
        {"setting": "trained", "variant": "prune", "seed": 0, "status": "failed", "folder": str(sweep / "x")},
    ]
    (sweep / "runs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in runs))
    assert main(["report", str(sweep)]) == 0
    page = html.unescape((sweep / SWEEP_PAGE).read_text())
    assert '<a href="trained/none/run/report.html">seed 0</a>' in page
    assert page.count("the client's above, the reconstruction below") == 3 and "ig, round 1, client 0, seed 0" in page
    assert "seed 0 failed" in page and "no reconstruction" in page  # the prune variant
