"""``fedguard report`` over rows with values of the wrong type and a grid that is not a PNG: each is named with
its file (and row), left out, and the report and the comparison figure are still written."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

import pytest
from PIL import Image

from fedguard.commands.cli import main
from fedguard.report.comparison import render_comparison
from fedguard.store.folder import (
    ATTACKS_FILE,
    COMPARISON_FILE,
    REPORT_FILE,
    ROUNDS_FILE,
    RunFolderWarning,
    grid_name,
    image_prefix,
)
from tests.test_run_folder import make_run, scored_row


def test_report_names_each_bad_value_and_corrupt_grid_and_is_still_written(tmp_path: Path) -> None:
    folder = make_run(tmp_path, ["ig", "dlg"])
    bad = {**scored_row(folder, "idlg", image_prefix(1, 1, "idlg")), "psnr": "high", "ssim": True, "floor": [1, 2]}
    with open(folder / ATTACKS_FILE, "a") as out:
        out.write(json.dumps(bad) + "\n")
    with open(folder / ROUNDS_FILE, "a") as out:
        out.write(json.dumps({"round": 3, "accuracy": "good", "loss": 1.0, "seconds": 1.0}) + "\n")
    corrupt = folder / grid_name(image_prefix(1, 0, "dlg"), "truth")
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n" + b"not a png")

    with pytest.warns(RunFolderWarning) as caught:
        assert main(["report", str(folder)]) == 0
    expected = [
        f"{folder / ATTACKS_FILE}, row 3: psnr = 'high' is not a number; left out",
        f"{folder / ATTACKS_FILE}, row 3: ssim = True is not a number; left out",
        f"{folder / ATTACKS_FILE}, row 3: floor = [1, 2] is not an object; left out",
        f"{folder / ROUNDS_FILE}, row 4: accuracy = 'good' is not a number; left out",
    ]
    warned = [str(w.message) for w in caught]
    for message in expected:
        assert warned.count(message) == 1, warned
    png_note = f"{corrupt}: not a readable PNG (Pillow finds no PNG image in it); not embedded"
    assert warned.count(png_note) == 1, warned

    page = (folder / REPORT_FILE).read_text()
    for message in [*expected, png_note]:
        assert escape(message) in page
    assert f"{escape(corrupt.relative_to(folder).as_posix())} is not a readable PNG; not embedded" in page
    assert page.count("data:image/png;base64,") == 7, "the two curves, ig's and idlg's pairs, dlg's reconstruction"
    assert "4 rows in rounds.jsonl" in page and "3 attacked uploads" in page
    with Image.open(folder / COMPARISON_FILE) as figure:
        figure.load()
    assert render_comparison(folder, lambda _: None) is not None


def test_the_comparison_draws_the_next_readable_upload_of_an_attack(tmp_path: Path) -> None:
    folder = make_run(tmp_path, ["ig"])
    with open(folder / ATTACKS_FILE, "a") as out:
        out.write(json.dumps({**scored_row(folder, "ig", image_prefix(1, 1, "ig")), "client": 1}) + "\n")
    clean = render_comparison(folder)
    (folder / grid_name(image_prefix(1, 0, "ig"), "recon")).write_bytes(b"GIF89a")
    notes: list[str] = []
    assert render_comparison(folder, notes.append) not in (None, clean), "client 1's upload drawn instead"
    assert notes == [
        f"{folder / grid_name(image_prefix(1, 0, 'ig'), 'recon')}: not a readable PNG (Pillow finds "
        "no PNG image in it); not embedded"
    ]
