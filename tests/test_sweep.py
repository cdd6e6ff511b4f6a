"""Sweeps: validation of every run up front, the summary table, real runs that resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedguard.config import ConfigError, load_config
from fedguard.report.paper_table import render_paper_table
from fedguard.sweep import SUMMARY_FILE, SWEEP_FILE, load_sweep, run_sweep, summarize_run, summary_table

SMALL = """
name = "small"
[data]
name = "digits"
[model]
name = "mlp"
[model.mlp]
hidden = 16
[partition]
num-clients = 3
[train]
rounds = 2
clients-per-round = 3
batch-size = 8
[sim]
num-cpus = 2
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return path


def test_runs_are_settings_times_variants_with_overrides_in_order(tmp_path: Path) -> None:
    preset = write(tmp_path, SMALL + """
[sweep]
baseline = "none"
[sweep.settings.short]
"train.rounds" = 1
[sweep.settings.long]
train = { rounds = 3 }
[sweep.variants.none]
"defense.name" = "none"
[sweep.variants.dp]
defense = { name = "dp", dp = { noise-multiplier = 0.5 } }
[sweep.variants.dp-long]
"defense.name" = "dp"
"train.rounds" = 4
""")
    sweep = load_sweep(preset, tmp_path / "out")
    assert [(r.setting, r.variant) for r in sweep.runs] == [
        ("short", "none"), ("short", "dp"), ("short", "dp-long"), ("long", "none"), ("long", "dp"), ("long", "dp-long")]
    by = {(r.setting, r.variant): r for r in sweep.runs}
    assert by["short", "none"].config.train.rounds == 1 and by["long", "dp"].config.train.rounds == 3
    assert by["short", "dp-long"].config.train.rounds == 4  # the variant's keys come last
    assert by["long", "dp"].config.defense.params.noise_multiplier == 0.5
    assert by["long", "dp"].folder == tmp_path / "out" / "long" / "dp"
    assert sweep.baseline == "none"


def test_every_problem_of_every_run_is_reported_before_anything_runs(tmp_path: Path) -> None:
    preset = write(tmp_path, SMALL + """
[sweep]
[sweep.variants.a]
"defense.name" = "nope"
[sweep.variants.b]
"train.rounds" = 0
""")
    with pytest.raises(ConfigError) as caught:
        load_sweep(preset)
    problems = caught.value.problems
    assert any(p.startswith("run/a: defense.name = 'nope'") for p in problems), problems
    assert any(p.startswith("run/b: train.rounds = 0") for p in problems), problems
    with pytest.raises(ConfigError, match="baseline = 'c' is not one of the variants: a"):
        load_sweep(write(tmp_path, SMALL + '[sweep]\nbaseline = "c"\n[sweep.variants.a]\n"seed" = 1\n'))
    with pytest.raises(ConfigError, match="no \\[sweep\\] table"):
        load_sweep(write(tmp_path, SMALL))
    with pytest.raises(ConfigError, match="unknown key"):
        load_sweep(write(tmp_path, SMALL + '[sweep]\nvariant = 1\n'))


def test_summary_table_gives_accuracy_as_a_share_of_the_baseline() -> None:
    rows = [
        {"setting": "s", "variant": "none", "accuracy": 0.8, "strongest_attack": "idlg", "psnr": 40.0, "ssim": 0.99,
         "lpips": 0.01, "leaked_images": 2, "images": 2, "seconds_per_round": 0.5, "rounds": 5},
        {"setting": "s", "variant": "dp", "accuracy": 0.6, "strongest_attack": "ig", "psnr": 12.0, "ssim": 0.2,
         "lpips": 0.5, "leaked_images": 0, "images": 2, "seconds_per_round": 0.6, "rounds": 5},
        {"setting": "u", "variant": "none", "accuracy": 0.9, "seconds_per_round": 0.1, "rounds": 1},
    ]
    table = summary_table(rows, "none").splitlines()
    assert table[0].startswith("| variant | s: strongest attack | PSNR (dB) | SSIM | LPIPS | SSIM > 0.9 | accuracy")
    assert table[0].endswith("| % of baseline | s/round | u: s/round |")  # u attacked nothing, trained 1 round
    assert table[2] == "| `none` | `idlg` | 40.0 | 0.990 | 0.010 | 2 of 2 | 80.0% | 100.0% | 0.50 | 0.10 |"
    assert table[3] == "| `dp` | `ig` | 12.0 | 0.200 | 0.500 | 0 of 2 | 60.0% | 75.0% | 0.60 | - |"


def test_the_strongest_attack_is_the_one_with_the_highest_mean_ssim(tmp_path: Path) -> None:
    [run] = load_sweep(write(tmp_path, SMALL + '[sweep]\n[sweep.variants.a]\n"seed" = 1\n'), tmp_path / "out").runs
    run.folder.mkdir(parents=True)
    rows = [{"attack": "ig", "status": "ok", "psnr": 20.0, "ssim": 0.5, "lpips": 0.3, "per_image": [{}],
             "leaked_images": 0, "floor": {"psnr": 15.0}},
            {"attack": "idlg", "status": "ok", "psnr": 35.0, "ssim": 0.95, "lpips": 0.05, "per_image": [{}],
             "leaked_images": 1, "floor": {"psnr": 15.0}},
            {"attack": "idlg", "status": "ok", "psnr": 25.0, "ssim": 0.85, "lpips": 0.15, "per_image": [{}],
             "leaked_images": 0, "floor": {"psnr": 17.0}},
            {"attack": "dlg", "status": "error", "psnr": None}]
    (run.folder / "attacks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize_run(run, "ok")
    assert summary["strongest_attack"] == "idlg" and set(summary["attacks"]) == {"ig", "idlg"}
    assert summary["psnr"] == 30.0 and summary["ssim"] == pytest.approx(0.9) and summary["floor_psnr"] == 16.0
    assert summary["leaked_images"] == 1 and summary["images"] == 2 and summary["accuracy"] is None


def test_the_table_shows_epsilon_and_raw_uploads_where_variants_report_them(tmp_path: Path) -> None:
    preset = write(tmp_path, SMALL + '[sweep]\n[sweep.variants.censor]\n"defense.name" = "censor"\n')
    [run] = load_sweep(preset, tmp_path / "out").runs
    run.folder.mkdir(parents=True)
    rounds = [{"round": 0, "accuracy": 0.1, "loss": 2.3, "seconds": 0.1},
              {"round": 1, "accuracy": 0.2, "loss": 2.0, "seconds": 1.0, "defense": {"raw": 0.5},
               "uploads": [{"client": 0, "raw": 1.0}, {"client": 1, "raw": 0.0}]},
              {"round": 2, "accuracy": 0.3, "loss": 1.9, "seconds": 1.0, "defense": {"raw": 0.0},
               "uploads": [{"client": 0, "raw": 0.0}, {"client": 1, "raw": 0.0}]}]
    attacks = [{"attack": "ig", "status": "ok", "round": r, "client": c, "psnr": 20.0, "ssim": 0.5, "lpips": 0.3,
                "per_image": [{}], "leaked_images": 0} for r, c in ((1, 0), (1, 1), (2, 0))]
    attacks.append({**attacks[0], "attack": "idlg"})  # a second attack on the same upload counts once
    (run.folder / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    (run.folder / "attacks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in attacks))
    summary = summarize_run(run, "ok")
    assert (summary["raw_fraction"], summary["raw_attacked"], summary["attacked_uploads"]) == (0.25, 1, 3)
    rows = [{**summary, "setting": "p"}, {**summary, "setting": "u", "images": 0},
            {"setting": "p", "variant": "dp", "epsilon": 2.1e6, "images": 3, "leaked_images": 0, "rounds": 2},
            {"setting": "u", "variant": "dp-sgd", "epsilon": 6.34, "rounds": 2}]
    table = summary_table(rows, "censor").splitlines()
    assert "| SSIM > 0.9 | accuracy | % of baseline | epsilon | raw uploads | s/round | u: accuracy |" in table[0]
    assert table[2].split(" | ")[8:11] == ["-", "1 of 3", "1.00"] and table[2].split(" | ")[13:15] == ["-", "25%"]
    assert table[3].split(" | ")[8:10] == ["2.1e+06", "-"] and table[4].split(" | ")[-3:-1] == ["6.34", "-"]


@pytest.mark.slow
def test_a_sweep_runs_each_variant_and_resumes(tmp_path: Path) -> None:
    preset = write(tmp_path, SMALL + """
[sweep]
baseline = "none"
[sweep.variants.none]
"defense.name" = "none"
[sweep.variants.dp]
defense = { name = "dp", dp = { noise-multiplier = 0.05 } }
""")
    sweep = load_sweep(preset, tmp_path / "out")
    lines: list[str] = []
    rows = run_sweep(sweep, lines.append, timeout=300)
    assert [r["status"] for r in rows] == ["ok", "ok"], lines
    assert all(r["rounds"] == 2 and 0 <= r["accuracy"] <= 1 for r in rows)
    assert (tmp_path / "out" / SUMMARY_FILE).read_text().count("\n") == 4
    assert [json.loads(line)["variant"] for line in (tmp_path / "out" / SWEEP_FILE).read_text().splitlines()] == ["none", "dp"]
    again: list[str] = []
    run_sweep(sweep, again.append)
    assert all("finished earlier, kept" in line for line in again), again


def test_a_sweep_preset_given_to_run_says_to_sweep_it(tmp_path: Path) -> None:
    preset = write(tmp_path, SMALL + '[sweep]\n[sweep.variants.a]\n"seed" = 1\n')
    with pytest.raises(ConfigError, match=r"describes a sweep of several runs .*`fedguard sweep .*sweep.toml`"):
        load_config(preset)


PAPER = SMALL + """
[sweep]
baseline = "none"
[sweep.variants.none]
"defense.name" = "none"
[sweep.variants.dgp]
"defense.name" = "dgp"
[sweep.paper]
title = "DGP (Xue et al.)"
[[sweep.paper.rows]]
what = "accuracy kept"
paper = "99.1% (Table 2)"
run = "run/dgp"
metric = "accuracy_share"
format = "{:.1%}"
differs = "digits, 3 clients"
[[sweep.paper.rows]]
what = "IG SSIM at round 5"
paper = "0.1 (Fig. 4)"
run = "run/dgp"
metric = "by_round.5.ssim"
differs = "MLP"
[[sweep.paper.rows]]
what = "upload share"
paper = "0.2"
run = "run/none"
metric = "upload_share"
differs = "-"
"""


def test_a_reproduction_preset_prints_the_papers_number_beside_ours(tmp_path: Path) -> None:
    sweep = load_sweep(write(tmp_path, PAPER), tmp_path / "out")
    assert sweep.paper is not None and [r.run for r in sweep.paper.rows] == ["run/dgp", "run/dgp", "run/none"]
    rows = [{"setting": "run", "variant": "none", "accuracy": 0.8},
            {"setting": "run", "variant": "dgp", "accuracy": 0.6,
             "by_round": {"1": {"ssim": 0.31}, "5": {"ssim": 0.12345}}}]
    table = render_paper_table(sweep.paper, rows, "none").splitlines()
    assert table[0] == "## DGP (Xue et al.)"
    assert table[4] == "| accuracy kept | 99.1% (Table 2) | 75.0% | `run/dgp` | digits, 3 clients |"
    assert table[5] == "| IG SSIM at round 5 | 0.1 (Fig. 4) | 0.123 | `run/dgp` | MLP |"
    assert table[6] == "| upload share | 0.2 | not measured | `run/none` | - |"


@pytest.mark.parametrize(("change", "message"), [
    ('run = "run/dgp"\nmetric = "accuracy_share"', "run 'run/dgpx' is not a <setting>/<variant> of this sweep"),
    ('format = "{:.1%}"', "format '{:.1q}' cannot print a number"),
    ('differs = "digits, 3 clients"', "paper row 1: missing 'differs'"),
])
def test_a_bad_paper_row_is_named(tmp_path: Path, change: str, message: str) -> None:
    broken = {'run = "run/dgp"\nmetric = "accuracy_share"': 'run = "run/dgpx"\nmetric = "accuracy_share"',
              'format = "{:.1%}"': 'format = "{:.1q}"',
              'differs = "digits, 3 clients"': ''}[change]
    with pytest.raises(ConfigError) as error:
        load_sweep(write(tmp_path, PAPER.replace(change, broken, 1)), tmp_path / "out")
    assert message in str(error.value)
