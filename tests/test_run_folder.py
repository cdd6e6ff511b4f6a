"""The run folder never lies: whole files appear whole, rows are strict JSON, a torn last line is skipped and
named, a damaged line is named, grids from outside the folder are refused, unreadable uploads are skipped."""

from __future__ import annotations

import io
import json
import math
import os
import time
import tracemalloc
import warnings
from pathlib import Path

import pytest
import torch

import fedguard.store.folder as folder_module
from fedguard import limits
from fedguard.commands.cli import main
from fedguard.commands.sweep import load_sweep, run_sweep
from fedguard.config import load_config
from fedguard.report.comparison import render_comparison, write_comparison
from fedguard.report.html import build_report
from fedguard.report.images import save_grid
from fedguard.report.rounds import RoundRecorder
from fedguard.report.run_status import write_status
from fedguard.store.folder import (
    ATTACKS_FILE,
    COMPARISON_FILE,
    GRID_KINDS,
    OBSERVATIONS_DIR,
    REPORT_FILE,
    ROUNDS_FILE,
    SUMMARY_FILE,
    SWEEP_FILE,
    JsonlAppender,
    RunFileError,
    RunFolderWarning,
    grid_name,
    image_prefix,
    read_json,
    read_jsonl,
    write_atomic,
    write_json,
    write_jsonl,
)
from fedguard.store.rows import busy_span
from fedguard.store.run_dir import prepare_run_dir
from tests.commands import QUICK_IG, settings
from tests.test_evaluation import make_run as make_captured_run
from tests.test_sweep import SMALL

TORN = b'{"round": 9, "accuracy": 0.'
LOGS = [ROUNDS_FILE, ATTACKS_FILE]


def strict(line: str) -> dict:
    """``line`` parsed as strict JSON: a NaN or Infinity token raises."""

    def refuse(token: str) -> None:
        raise ValueError(f"non-strict JSON token {token}")

    return json.loads(line, parse_constant=refuse)


def tear(path: Path) -> None:
    """Leave what a run killed while writing a row leaves: a partial last line without its newline."""
    with open(path, "ab") as out:
        out.write(TORN)


def scored_row(folder: Path, attack: str, prefix: str) -> dict:
    """An ``ok`` attack row whose grids are saved at ``folder/<prefix>_{truth,recon}.png`` (wherever that leads)."""
    truth = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(len(prefix)))
    for kind, images in zip(GRID_KINDS, (truth, 1 - truth)):
        save_grid(images, folder / grid_name(prefix, kind), scale=None)
    return {
        "round": 1,
        "client": 0,
        "attack": attack,
        "defense": "none",
        "status": "ok",
        "images": prefix,
        "batch_size": 2,
        "psnr": 12.0,
        "ssim": 0.5,
        "lpips": 0.2,
        "label_accuracy": 1.0,
        "seconds": 1.0,
    }


def make_run(tmp_path: Path, attacks: list[str] = ("ig",)) -> Path:
    """A small run folder: config, three rounds, one scored row with grids per attack in ``attacks``."""
    config = load_config(None, [f"out-dir={tmp_path / 'run'}", "name=run-folder", "data.name=photos", "train.rounds=2"])
    folder = prepare_run_dir(config)
    write_jsonl(
        folder / ROUNDS_FILE, [{"round": r, "accuracy": 0.2 * r, "loss": 2.0 - r / 2, "seconds": 1.0} for r in range(3)]
    )
    write_jsonl(folder / ATTACKS_FILE, [scored_row(folder, name, image_prefix(1, 0, name)) for name in attacks])
    return folder


# ----------------------------------------------------------------------------------------------
# Strict JSON, the appender, the reader, the atomic writer
# ----------------------------------------------------------------------------------------------


def test_rows_with_non_finite_floats_are_strict_json_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    row = {
        "round": 1,
        "loss": math.nan,
        "accuracy": math.inf,
        "seconds": 0.5,
        "defense": {"a/b~c": -math.inf},
        "per_image": [{"psnr": 3.0}, {"psnr": math.nan}],
    }
    with JsonlAppender(path) as rows:
        rows.append(row)
    [line] = path.read_text().splitlines()
    on_disk = strict(line)
    assert on_disk["loss"] is None and on_disk["accuracy"] is None and on_disk["defense"] == {"a/b~c": None}
    assert on_disk["non_finite"] == {
        "/loss": "NaN",
        "/accuracy": "Infinity",
        "/defense/a~1b~0c": "-Infinity",
        "/per_image/1/psnr": "NaN",
    }
    [back] = read_jsonl(path)
    assert math.isnan(back["loss"]) and back["accuracy"] == math.inf and back["defense"]["a/b~c"] == -math.inf
    assert back["per_image"][0] == {"psnr": 3.0} and math.isnan(back["per_image"][1]["psnr"])
    assert "non_finite" not in back and back["seconds"] == 0.5
    assert math.isnan(row["loss"]), "the caller's row is left as it was"

    write_json(tmp_path / "status.json", {"epsilon": math.inf})
    strict((tmp_path / "status.json").read_text())
    assert read_json(tmp_path / "status.json") == {"epsilon": math.inf}


def test_a_diverged_model_writes_strict_rounds(tmp_path: Path) -> None:
    recorder = RoundRecorder(tmp_path / ROUNDS_FILE, total_rounds=2, clients_per_round=1, out=io.StringIO())
    recorder.record(0, 2.3, 0.1)
    recorder.record(1, math.nan, math.nan, defense={"epsilon": math.inf})
    recorder.close()
    rows = [strict(line) for line in (tmp_path / ROUNDS_FILE).read_text().splitlines()]
    assert rows[1]["loss"] is None and rows[1]["non_finite"]["/defense/epsilon"] == "Infinity"


def test_round_and_attack_rows_carry_when_they_were_written_and_give_the_runs_busy_span(tmp_path: Path) -> None:
    before = time.time()
    recorder = RoundRecorder(tmp_path / ROUNDS_FILE, total_rounds=2, clients_per_round=1, out=io.StringIO())
    time.sleep(0.05)
    recorder.record(0, 2.3, 0.1)
    recorder.record(1, 2.2, 0.2)
    recorder.close()
    rounds = [json.loads(line) for line in (tmp_path / ROUNDS_FILE).read_text().splitlines()]
    assert before - 1e-3 <= rounds[0]["at"] <= rounds[1]["at"] <= time.time() + 1e-3  # kept to the millisecond
    write_jsonl(tmp_path / ATTACKS_FILE, [{"round": 1, "client": 0, "at": rounds[1]["at"] + 7.5}, {"round": 1}])
    start, end = busy_span(tmp_path) or (0.0, 0.0)
    assert start == pytest.approx(rounds[0]["at"] - rounds[0]["seconds"]) and start >= before - 1e-3
    assert end == rounds[1]["at"] + 7.5, "the last attack row ends the span"
    assert busy_span(tmp_path / "empty") is None


def test_a_torn_last_line_is_skipped_with_a_warning_and_a_damaged_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / ROUNDS_FILE
    write_jsonl(path, [{"round": 0}, {"round": 1}])
    tear(path)
    with pytest.warns(RunFolderWarning, match=r"rounds.jsonl: skipped the torn last line 3"):
        assert read_jsonl(path) == [{"round": 0}, {"round": 1}]
    path.write_text('{"round": 0}\n{"round": 1}')  # a whole last row that only lacks its newline is a row
    assert read_jsonl(path) == [{"round": 0}, {"round": 1}]
    path.write_text('{"round": 0}\n{"round": 1, "acc\n{"round": 2}\n')
    with pytest.raises(RunFileError, match=r"rounds.jsonl, line 2: not a row"):
        read_jsonl(path)
    path.write_text('{"round": 0}\n[1, 2]\n')
    with pytest.raises(RunFileError, match=r"line 2: not a row \(a JSON list, not an object\)"):
        read_jsonl(path)
    assert read_jsonl(tmp_path / "absent.jsonl") == []


def test_the_appender_starts_its_row_on_a_line_of_its_own(tmp_path: Path) -> None:
    path = tmp_path / ATTACKS_FILE
    write_jsonl(path, [{"n": 0}])
    tear(path)
    with (
        pytest.warns(RunFolderWarning, match=f"cut a torn last line \\({len(TORN)} bytes\\)"),
        JsonlAppender(path) as rows,
    ):
        rows.append({"n": 1})
    assert path.read_text() == '{"n": 0}\n{"n": 1}\n'
    path.write_text('{"n": 0}')
    with JsonlAppender(path) as rows:
        rows.append({"n": 1})
    assert path.read_text() == '{"n": 0}\n{"n": 1}\n'


@pytest.mark.parametrize("failing", ["fsync", "replace"])
def test_the_atomic_writer_leaves_the_old_file_or_the_new(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    path = write_atomic(tmp_path / REPORT_FILE, "old")
    real = getattr(os, failing)

    def crash(*args: object) -> None:
        assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir()), "the new text went to a temporary file"
        raise OSError("disk gone")

    monkeypatch.setattr(os, failing, crash)
    with pytest.raises(OSError, match="disk gone"):
        write_atomic(path, "new " * 10_000)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == [REPORT_FILE]
    monkeypatch.setattr(os, failing, real)
    write_atomic(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == [REPORT_FILE]


# ----------------------------------------------------------------------------------------------
# A line longer than any row
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def small_lines(monkeypatch: pytest.MonkeyPatch) -> int:
    """Lines of at most 64 bytes read, 16 of a line held at once: the bound and the chunked reading at a
    size a test writes."""
    monkeypatch.setattr(limits, "MAX_LINE_BYTES", 64)
    monkeypatch.setattr(folder_module, "_HELD", 16)
    return 64


def test_a_line_longer_than_the_bound_is_refused_naming_the_file_line_and_size(
    tmp_path: Path, small_lines: int
) -> None:
    path = tmp_path / ROUNDS_FILE
    fits = json.dumps({"round": 1, "pad": "x" * (small_lines - 23)})
    assert len(fits) == small_lines
    path.write_text(f'{{"round": 0}}\n{fits}\n{{"round": 2, "pad": "{"y" * 100}"}}\n{{"round": 3}}\n')
    with pytest.raises(RunFileError, match=r"rounds.jsonl, line 3: 123 bytes, longer than any row .*at most 64 bytes"):
        read_jsonl(path)
    path.write_text(f'{{"round": 0}}\n{fits}\n{{"round": 2}}')  # a row longer than a held chunk is read whole
    assert [row["round"] for row in read_jsonl(path)] == [0, 1, 2]
    path.write_text(f'{{"round": 0}}\n{fits[:40]}')  # a torn last line longer than a chunk is still a torn line
    with pytest.warns(RunFolderWarning, match=r"skipped the torn last line 2 \(40 bytes"):
        assert read_jsonl(path) == [{"round": 0}]
    path.write_text('{"round": 0}\n' + "z" * 65)  # over the bound without a newline: refused, not skipped
    with pytest.raises(RunFileError, match=r"line 2: 65 bytes"):
        read_jsonl(path)
    write_json(tmp_path / "status.json", {"status": "failed", "error": "e" * 100})
    with pytest.raises(RunFileError, match=r"status.json: 134 bytes, larger than any JSON file .*at most 64"):
        read_json(tmp_path / "status.json")


def test_the_appender_mends_a_long_tail_reading_it_backwards(tmp_path: Path, small_lines: int) -> None:
    path = tmp_path / ATTACKS_FILE
    row = json.dumps({"n": 1, "pad": "p" * 40})
    path.write_text('{"n": 0}\n' + row)  # a whole row, longer than a chunk, lacking its newline
    with JsonlAppender(path) as rows:
        rows.append({"n": 2})
    assert [r["n"] for r in read_jsonl(path)] == [0, 1, 2]
    path.write_text('{"n": 0}\n' + "q" * 200)  # over the bound: cut as a torn line
    with pytest.warns(RunFolderWarning, match=r"cut a torn last line \(200 bytes\)"), JsonlAppender(path) as rows:
        rows.append({"n": 1})
    assert path.read_text() == '{"n": 0}\n{"n": 1}\n'


def test_report_names_a_line_longer_than_the_bound(
    tmp_path: Path, small_lines: int, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = make_run(tmp_path)
    with open(folder / ROUNDS_FILE, "a") as out:
        out.write('{"round": 3, "pad": "' + "x" * 1000 + '"}\n')
    assert main(["report", str(folder)]) == 2
    assert f"{folder / ROUNDS_FILE}, line 4: 1023 bytes, longer than any row" in capsys.readouterr().err


def test_a_200_mb_line_is_refused_holding_a_small_part_of_it(tmp_path: Path) -> None:
    """The line is sparse (NUL bytes the file system does not store): its size costs no disk and no writing."""
    path = tmp_path / ROUNDS_FILE
    size = 200 * 2**20
    assert size > limits.MAX_LINE_BYTES
    with open(path, "wb") as out:
        out.write(b'{"round": 0}\n')
        out.truncate(out.tell() + size)
        out.seek(0, os.SEEK_END)
        out.write(b'\n{"round": 2}\n')
    tracemalloc.start()
    try:
        with pytest.raises(RunFileError, match=rf"line 2: {size} bytes, longer than any row"):
            read_jsonl(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * folder_module._HELD < size / 20


# ----------------------------------------------------------------------------------------------
# A torn last line in each reader of a run folder
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("log", LOGS)
def test_report_skips_a_torn_last_line_and_says_so(
    tmp_path: Path, log: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = make_run(tmp_path)
    tear(folder / log)
    with pytest.warns(RunFolderWarning, match=f"{log}: skipped the torn last line"):
        assert main(["report", str(folder)]) == 0
    assert capsys.readouterr().out.strip() == str(folder / REPORT_FILE)
    page = (folder / REPORT_FILE).read_text()
    assert f"{log}: skipped the torn last line" in page and page.count("data:image/png;base64,") == 4
    assert "3 rows in rounds.jsonl" in page and "1 attacked upload" in page


def test_report_names_a_damaged_line_in_the_middle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = make_run(tmp_path)
    lines = (folder / ATTACKS_FILE).read_text()
    (folder / ATTACKS_FILE).write_text(TORN.decode() + "\n" + lines)
    assert main(["report", str(folder)]) == 2
    assert f"{folder / ATTACKS_FILE}, line 1: not a row" in capsys.readouterr().err


@pytest.mark.parametrize("log", LOGS)
def test_comparison_skips_a_torn_last_line(tmp_path: Path, log: str) -> None:
    folder = make_run(tmp_path, ["ig", "dlg"])
    whole = render_comparison(folder)
    tear(folder / log)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert write_comparison(folder) == folder / COMPARISON_FILE
    messages = [str(w.message) for w in caught]
    assert len(messages) == (log == ATTACKS_FILE), "the figure reads attacks.jsonl only"
    assert all(f"{log}: skipped the torn last line" in message for message in messages)
    assert (folder / COMPARISON_FILE).read_bytes() == whole
    with pytest.warns(RunFolderWarning, match=f"{log}: skipped the torn last line"):
        build_report(folder)
    assert (folder / COMPARISON_FILE).read_bytes() == whole


@pytest.mark.parametrize("log", LOGS)
def test_sweep_skips_a_torn_last_line(tmp_path: Path, log: str) -> None:
    preset = tmp_path / "sweep.toml"
    preset.write_text(SMALL + '[sweep]\n[sweep.variants.none]\n"defense.name" = "none"\n')
    sweep = load_sweep(preset, tmp_path / "out")
    [run] = sweep.runs
    run.folder.mkdir(parents=True)
    write_jsonl(
        run.folder / ROUNDS_FILE, [{"round": r, "accuracy": 0.25 * r, "loss": 1.0, "seconds": 1.0} for r in range(3)]
    )
    write_status(run.folder, "completed", 2)
    write_jsonl(
        run.folder / ATTACKS_FILE,
        [
            {
                "attack": "ig",
                "status": "ok",
                "round": 1,
                "client": 0,
                "psnr": 20.0,
                "ssim": 0.5,
                "lpips": 0.3,
                "per_image": [{}],
                "leaked_images": 0,
            }
        ],
    )
    tear(run.folder / log)
    lines: list[str] = []
    with pytest.warns(RunFolderWarning, match=f"{log}: skipped the torn last line"):
        [row] = run_sweep(sweep, lines.append)
    assert "finished earlier, kept" in lines[0], lines
    assert row["accuracy"] == 0.5 and row["strongest_attack"] == "ig" and row["psnr"] == 20.0
    assert [strict(line)["variant"] for line in (tmp_path / "out" / SWEEP_FILE).read_text().splitlines()] == ["none"]
    assert "`ig`" in (tmp_path / "out" / SUMMARY_FILE).read_text()


IG = settings(QUICK_IG)


@pytest.mark.parametrize("log", LOGS)
def test_offline_attack_appends_after_a_torn_last_line(
    tmp_path: Path, log: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = make_captured_run(tmp_path, batch=1, clients=1)
    write_jsonl(
        folder / ATTACKS_FILE,
        [{"round": 1, "client": 0, "attack": "dlg", "status": "error", "error": "stopped", "images": None}],
    )
    tear(folder / log)
    with pytest.warns(RunFolderWarning, match="torn last line"):
        assert main(["attack", str(folder), *IG]) == 0
    assert "ig round 1 client 0: ok" in capsys.readouterr().out
    rows = [strict(line) for line in (folder / ATTACKS_FILE).read_text().splitlines()]
    assert [(r["attack"], r["status"]) for r in rows] == [("dlg", "error"), ("ig", "ok")]
    page = (folder / REPORT_FILE).read_text()
    assert ("skipped the torn last line" in page) == (log == ROUNDS_FILE), "attacks.jsonl was mended, not skipped"


# ----------------------------------------------------------------------------------------------
# Grids from outside the run folder; unreadable observations
# ----------------------------------------------------------------------------------------------


def test_grids_outside_the_run_folder_are_refused(tmp_path: Path) -> None:
    folder = make_run(tmp_path)
    only_inside = render_comparison(folder)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (folder / "images" / "link").symlink_to(outside, target_is_directory=True)
    escaping = {"dlg": "../elsewhere/up", "idlg": str(outside / "absolute"), "imprint": "images/link/through"}
    with open(folder / ATTACKS_FILE, "a") as out:
        for attack, prefix in escaping.items():
            out.write(json.dumps(scored_row(folder, attack, prefix)) + "\n")
    assert all((folder / grid_name(prefix, "truth")).is_file() for prefix in escaping.values())

    with pytest.warns(RunFolderWarning, match="outside the run folder") as caught:
        page = build_report(folder).read_text()
    refused = {grid_name(prefix, kind) for prefix in escaping.values() for kind in GRID_KINDS}
    assert sorted(str(w.message).split(" resolves")[0] for w in caught) == sorted(refused), "each warned once"
    assert page.count("data:image/png;base64,") == 4, "the two curves and the one grid pair inside the folder"
    for name in refused:
        assert f"{name} resolves outside the run folder" in page
        assert f"{name} is outside the run folder; not embedded" in page
    assert (folder / COMPARISON_FILE).read_bytes() == only_inside, "only the attack inside the folder has a band"


def test_offline_attack_skips_unreadable_observations(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = make_captured_run(tmp_path, batch=1, clients=3)
    observations = sorted((folder / OBSERVATIONS_DIR).iterdir())
    truncated, foreign = observations[0], observations[2]
    truncated.write_bytes(truncated.read_bytes()[:200])
    foreign.write_text("not an upload")
    assert main(["attack", str(folder), *IG]) == 0
    out = capsys.readouterr().out
    assert f"skipped {truncated}: unreadable (" in out and f"skipped {foreign}: unreadable (" in out
    assert "ig on 1 of 1 observations" in out and "2 observations of 3 skipped (unreadable, or not of this run)" in out
    [row] = read_jsonl(folder / ATTACKS_FILE)
    assert (row["client"], row["status"]) == (1, "ok")
    assert (folder / REPORT_FILE).is_file()
