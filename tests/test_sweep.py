"""Sweeps: validation of every run up front, the summary table, real runs that resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedguard.config import ConfigError, load_config
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
