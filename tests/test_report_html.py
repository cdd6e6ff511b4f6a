"""report.html: one self-contained page, checked in the text and rendered in headless Chromium."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedguard.commands.cli import main
from fedguard.config import load_config
from fedguard.report.html import DASH, _uploads_table, build_report
from fedguard.report.images import save_grid
from fedguard.store.run_dir import prepare_run_dir

CHROMIUM = Path("/usr/bin/chromium")
ROUNDS = 6
OK_ROW = {
    "round": 1,
    "client": 3,
    "attack": "inverting-gradients",
    "defense": "none",
    "batch_size": 4,
    "mse": 0.0012,
    "psnr": 29.21,
    "ssim": 0.9413,
    "lpips": 0.0871,
    "label_accuracy": 1.0,
    "seconds": 12.34,
    "seed": 0,
    "status": "ok",
    "error": None,
    "images": "images/round-0001_client-0003",
}
ERROR_ROW = {
    "round": 2,
    "client": 5,
    "attack": "inverting-gradients",
    "defense": "none",
    "batch_size": 4,
    "mse": None,
    "psnr": None,
    "ssim": None,
    "lpips": None,
    "label_accuracy": None,
    "seconds": 0.5,
    "seed": 0,
    "status": "error",
    "error": "RuntimeError: gradient <shape> mismatch & more",
    "images": None,
}


def natural_batch() -> torch.Tensor:
    """Four 32x32 RGB crops of scikit-image's astronaut photo, (4, 3, 32, 32) in [0, 1]."""
    from skimage import data

    photo = torch.from_numpy(data.astronaut()[::4, ::4].copy()).permute(2, 0, 1).float() / 255  # 3x128x128
    corners = [(10, 40), (60, 20), (70, 80), (20, 90)]
    return torch.stack([photo[:, top : top + 32, left : left + 32] for top, left in corners])


def make_run(root: Path, attacks: list[dict] | None) -> Path:
    """A run folder as `fedguard run` and the attack step leave it (attacks None: no attacks.jsonl)."""
    config = load_config(
        None,
        [
            f"out-dir={root / 'run'}",
            "name=report-test",
            "data.name=photos",
            f"train.rounds={ROUNDS}",
            "attack.name=ig,idlg",
        ],
    )
    folder = prepare_run_dir(config)
    with open(folder / "rounds.jsonl", "w") as out:
        for r in range(ROUNDS + 1):
            out.write(
                json.dumps({"round": r, "accuracy": 0.1 + 0.13 * r, "loss": 2.3 / (1 + r), "seconds": 1.5}) + "\n"
            )
    if attacks is not None:
        (folder / "attacks.jsonl").write_text("".join(json.dumps(row) + "\n" for row in attacks))
        truth = natural_batch()
        recon = (truth + 0.08 * torch.randn(truth.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
        for row in attacks:
            if row["images"]:
                save_grid(truth, folder / f"{row['images']}_truth.png", scale=None)
                save_grid(recon, folder / f"{row['images']}_recon.png", scale=None)
    return folder


def img_count(page: str) -> int:
    return len(re.findall(r"<img\b", page))


def chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess[str]:
    command = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_save_grid_layout_grayscale_and_atomic_write(tmp_path: Path) -> None:
    gray = torch.zeros(5, 1, 8, 8)
    path = save_grid(gray, tmp_path / "sub" / "gray.png", columns=3, scale=2)
    image = Image.open(path)
    assert image.mode == "L" and image.size == (3 * 16 + 2, 2 * 16 + 1)
    pixels = np.asarray(image)
    assert (pixels[:, 16] == 255).all() and (pixels[16, :] == 255).all(), "1-pixel white separators"
    assert (pixels[:16, :16] == 0).all() and (pixels[17:, 34:] == 255).all(), "cells, then white past the last image"
    rgb = save_grid(natural_batch(), tmp_path / "rgb.png", scale=None)  # 32 px -> cells of 64 px
    assert Image.open(rgb).mode == "RGB" and Image.open(rgb).size == (2 * 64 + 1, 2 * 64 + 1)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["gray.png", "rgb.png", "sub"], "no temporary file left"


def test_report_holds_tables_and_embedded_images(tmp_path: Path) -> None:
    folder = make_run(tmp_path, [OK_ROW, ERROR_ROW])
    page = build_report(folder).read_text()
    assert (folder / "report.html").is_file()
    for text in (
        "report-test",
        "photos",
        "fedsgd",
        "<dt>strategy</dt><dd>fedsgd</dd>",
        "29.21",
        "0.941",
        "0.087",
        "<dt>attacks</dt><dd>ig (iterations=2000, restarts=1,",
        "; idlg (iterations=",
        "100.0%",
        "12.3",
        "88.0%",
        "1 of 1",
        "upload-1",
    ):
        assert text in page, text
    assert "RuntimeError: gradient &lt;shape&gt; mismatch &amp; more" in page, "error text shown, escaped"
    assert "<shape>" not in page
    assert img_count(page) == 4 and page.count("data:image/png;base64,") == 4  # 2 curves + truth + recon
    assert "mean SSIM of each attack per attacked round" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//)""", page), "nothing loaded from outside"
    assert "http://" not in page and "https://" not in page


def test_report_without_attacks_and_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = make_run(tmp_path, None)
    assert main(["report", str(folder)]) == 0
    assert capsys.readouterr().out.strip() == str(folder / "report.html")
    page = (folder / "report.html").read_text()
    assert "No upload was attacked in this run" in page and img_count(page) == 1
    (folder / "attacks.jsonl").write_text("")
    assert "No upload was attacked in this run" in build_report(folder).read_text()

    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "nowhere not found" in capsys.readouterr().err
    (folder / "rounds.jsonl").unlink()
    assert main(["report", str(folder)]) == 2
    assert "no rounds.jsonl" in capsys.readouterr().err


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install chromium)")
def test_report_renders_in_chromium(tmp_path: Path) -> None:
    folder = make_run(tmp_path, [OK_ROW, ERROR_ROW])
    report = build_report(folder)
    expected = img_count(report.read_text())
    url = report.resolve().as_uri()

    dom = chromium(["--virtual-time-budget=5000", "--dump-dom", url], tmp_path / "profile-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert img_count(dom.stdout) == expected
    loaded = re.search(r'data-images-loaded="(\d+)"', dom.stdout)
    assert loaded, "the page's load script did not run:\n" + dom.stdout[:500]
    assert int(loaded.group(1)) == expected, "every embedded image decodes"

    shot = tmp_path / "shot.png"
    done = chromium(
        ["--window-size=1280,2400", "--hide-scrollbars", f"--screenshot={shot}", url], tmp_path / "profile-shot"
    )
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=np.float32)
    assert pixels.shape[:2] == (2400, 1280) and pixels.std() > 20, "the screenshot is not blank"
    if keep := os.environ.get("FEDGUARD_REPORT_SHOT"):  # a path, to look at the page
        shutil.copy(shot, keep)


def test_a_plugin_run_is_reported_where_its_plugins_cannot_be_imported(tmp_path: Path) -> None:
    """The report reads the keys config.toml recorded: no plugin imported, nothing validated again."""
    import tomllib

    import tomli_w

    folder = make_run(tmp_path, [OK_ROW])
    recorded = tomllib.loads((folder / "config.toml").read_text())
    recorded["server"]["plugins"] = "lab_plugins.sign_flip"  # importable only in the lab's own folder
    recorded["defense"]["name"] = "sign-flip"
    recorded["defense"]["sign-flip"] = {"scale": 2.5}
    (folder / "config.toml").write_text(tomli_w.dumps(recorded))
    page = build_report(folder).read_text()
    assert "could not be read" not in page and "cannot import" not in page
    assert "<dt>defense</dt><dd>sign-flip (scale=2.5)</dd>" in page
    assert "<h1>report-test</h1>" in page and "<dt>dataset</dt><dd>photos</dd>" in page


def test_a_missing_or_broken_configuration_is_named_and_the_report_still_written(tmp_path: Path) -> None:
    folder = make_run(tmp_path, [OK_ROW])
    (folder / "config.toml").write_text("train = [unclosed")
    page = build_report(folder).read_text()
    assert "config.toml could not be read: preset" in page and "is not valid TOML" in page
    (folder / "config.toml").unlink()
    assert "config.toml is missing" in build_report(folder).read_text()


def test_each_upload_shows_its_best_matched_image() -> None:
    """A fishing row's mean SSIM is low by construction (one image in every slot); its best image is the figure."""
    fished = {**OK_ROW, "attack": "feature-fishing", "ssim": 0.3, "best_ssim": 0.9713}
    hostile = {**OK_ROW, "best_ssim": "high"}
    table = _uploads_table([fished, hostile, OK_ROW], {})
    assert "best image SSIM" in table and "0.971" in table
    assert table.count("<tr") == 4 and table.count(DASH) >= 2, "no number: a dash, for a bad row and a row without"


def test_the_report_lists_every_client_a_round_went_without(tmp_path: Path) -> None:
    folder = make_run(tmp_path, None)
    rows = [json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines()]
    rows[1].update(clients=2, failures=1, failed=[{"client": 3, "node": 41, "reason": "ValueError: <broke>"}])
    rows[2].update(clients=1, rejected=[{"client": 0, "reason": "shape (3,) where (2,) was sent"}], stragglers=[5])
    rows[2]["detect"] = [{"client": 2, "structure": 9.5, "action": "skip"}, {"client": 1, "action": "report"}]
    rows[3].update(failures=2)  # a row from before failures named their clients
    (folder / "rounds.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    page = html.unescape(build_report(folder).read_text())
    panel = page[page.index("<h2>Clients left out of a round</h2>") :].split("</section>")[0]
    assert "3 failed, 1 straggler, 1 rejected, 1 declined" in panel
    cells = re.findall(
        r"<tr><td>(\d+)</td><td>([^<]+)</td><td><span[^>]*>(\w+)</span></td><td><code>(.*?)</code>", panel
    )
    assert cells == [
        ("1", "3 (node 41)", "failed", "ValueError: <broke>"),
        ("2", "5", "straggler", "no reply within server.round-timeout"),
        ("2", "0", "rejected", "shape (3,) where (2,) was sent"),
        ("2", "2", "declined", "skip: its detectors flagged the model it received"),
        ("3", "?", "failed", "2 client(s); no reason recorded"),
    ]
    assert '<div class="label">clients left out</div><div class="value">6</div>' in page
    assert "<th>uploads aggregated</th>" in page and "<td>2</td><td>1.5</td>" in page
    quiet = make_run(tmp_path / "quiet", None)
    assert "Clients left out" not in build_report(quiet).read_text()
