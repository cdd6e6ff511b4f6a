"""Sweeps: validation of every run up front, the summary table, real runs that resume."""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from fedguard.commands.sweep import (
    SUMMARY_FILE,
    SWEEP_FILE,
    load_sweep,
    run_sweep,
    summarize_runs,
    summary_table,
    summary_tables,
)
from fedguard.config import Config, ConfigError, load_config
from fedguard.report.paper_table import render_paper_table
from fedguard.report.run_status import read_status, write_status
from fedguard.store.checkpoint import RoundCheckpoint, write_checkpoint
from fedguard.store.lock import hold
from fedguard.store.run_dir import config_toml
from tests.test_report_html import CHROMIUM, chromium, img_count

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

IDLG_ROUND_1 = """
[capture]
rounds = "1"
clients = "0"
[attack]
name = "idlg"
[attack.idlg]
iterations = 20
device = "cpu"
"""  # a quick attack on client 0's upload of round 1


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return path


def test_runs_are_settings_times_variants_with_overrides_in_order(tmp_path: Path) -> None:
    preset = write(
        tmp_path,
        SMALL
        + """
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
""",
    )
    sweep = load_sweep(preset, tmp_path / "out")
    assert [(r.setting, r.variant) for r in sweep.runs] == [
        ("short", "none"),
        ("short", "dp"),
        ("short", "dp-long"),
        ("long", "none"),
        ("long", "dp"),
        ("long", "dp-long"),
    ]
    by = {(r.setting, r.variant): r for r in sweep.runs}
    assert by["short", "none"].config.train.rounds == 1 and by["long", "dp"].config.train.rounds == 3
    assert by["short", "dp-long"].config.train.rounds == 4  # the variant's keys come last
    assert by["long", "dp"].config.defense.params.noise_multiplier == 0.5
    assert by["long", "dp"].folder == tmp_path / "out" / "long" / "dp"
    assert sweep.baseline == "none"


def test_every_problem_of_every_run_is_reported_before_anything_runs(tmp_path: Path) -> None:
    preset = write(
        tmp_path,
        SMALL
        + """
[sweep]
[sweep.variants.a]
"defense.name" = "nope"
[sweep.variants.b]
"train.rounds" = 0
""",
    )
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
        load_sweep(write(tmp_path, SMALL + "[sweep]\nvariant = 1\n"))


def leak(attack: str, psnr: float, ssim: float, lpips: float, rate: float, **changes: object) -> dict:
    """A ``privacy`` object as ``fedguard.report.leakage.privacy`` writes it, with the scores the table shows."""
    return {
        "attack": attack,
        "adaptive": False,
        "round": 1,
        "n_images": 2,
        "seeds": [0],
        "psnr_mean": psnr,
        "ssim_mean": ssim,
        "ssim_ci95": [ssim - 0.1, ssim + 0.05],
        "lpips_mean": lpips,
        "success_rate": rate,
        **changes,
    }


def test_summary_table_gives_accuracy_as_a_share_of_the_baseline() -> None:
    rows = [
        {
            "setting": "s",
            "variant": "none",
            "accuracy": 0.8,
            "privacy": leak("idlg", 40.0, 0.9, 0.01, 1.0),
            "seconds_per_round": 0.5,
            "rounds": 5,
            "seeds": [0],
        },
        {
            "setting": "s",
            "variant": "dp",
            "accuracy": 0.6,
            "seconds_per_round": 0.6,
            "rounds": 5,
            "accuracy_ci95": [0.5, 0.7],
            "seeds": [0, 1, 2],
            "privacy": leak("ig", 12.0, 0.2, 0.5, 0.0, adaptive=True, round=5, n_images=6, seeds=[0, 1, 2]),
        },
        {"setting": "u", "variant": "none", "accuracy": 0.9, "seconds_per_round": 0.1, "rounds": 1},
    ]
    table = summary_table(rows, "none").splitlines()
    assert table[0].startswith(
        "| variant | s: attack, round | images | PSNR (dB) | SSIM [95% CI] | LPIPS | SSIM > 0.5 | accuracy"
    )
    assert table[0].endswith("| % of baseline | s/round | u: s/round |")  # u attacked nothing, trained 1 round
    assert table[2] == (
        "| `none` | `idlg`, round 1 | 2, not a verdict | 40.0 | 0.90 [0.80, 0.95] | 0.010 | 100% | 80.0% | 100.0% "
        "| 0.50 | 0.10 |"
    )
    assert table[3] == (
        "| `dp` | `ig` adaptive, round 5 | 6 (3 seeds), not a verdict | 12.0 | 0.20 [0.10, 0.25] | 0.500 | 0% "
        "| 60.0% [50.0, 70.0] | 75.0% | 0.60 | - |"
    )


def test_a_setting_whose_baseline_accuracy_is_unsettled_prints_no_accuracy_and_says_why() -> None:
    """The undefended interval over seeds of setting 'wide' spans +-28 points: no accuracy column for it; 'tight'
    (+-1.4) keeps its own."""
    base = {"rounds": 30, "seconds_per_round": 0.5, "seeds": [0, 1, 2]}
    rows = [
        {**base, "setting": "wide", "variant": "none", "accuracy": 0.64, "accuracy_ci95": [0.36, 0.92]},
        {**base, "setting": "wide", "variant": "dp", "accuracy": 0.13, "accuracy_ci95": [0.10, 0.17]},
        {**base, "setting": "tight", "variant": "none", "accuracy": 0.883, "accuracy_ci95": [0.869, 0.897]},
        {**base, "setting": "tight", "variant": "dp", "accuracy": 0.17, "accuracy_ci95": [0.04, 0.30]},
    ]
    table = summary_table(rows, "none").splitlines()
    assert table[0] == "| variant | wide: s/round | tight: accuracy | % of baseline | s/round |"
    assert table[3] == "| `dp` | 0.50 | 17.0% [4.0, 30.0] | 19.3% | 0.50 |"
    assert table[-1] == (
        "- `wide`: accuracy left out: the `none` accuracy's 95 % interval over seeds is +-28.0 points, wider than "
        "+-3, so it cannot tell the defenses apart (sweep.jsonl keeps every cell's)"
    )


SECURE = "malicious, secure aggregation"


def test_summary_tables_give_each_setting_its_own_table_under_its_kind_and_threat_model() -> None:
    base = {"rounds": 1, "seconds_per_round": 0.5, "seeds": [0], "privacy": leak("imprint", 20.0, 0.6, 0.1, 0.5)}
    rows = [
        {**base, "setting": "plain", "variant": "none", "setting_kind": "realistic", "threat": "honest"},
        {**base, "setting": "sum", "variant": "none", "setting_kind": "realistic", "threat": SECURE},
        {"setting": "sum", "variant": "dp", "status": "failed"},
    ]
    tables = summary_tables(rows, "none").splitlines()
    assert tables[0] == "Setting `plain` (realistic; threat: honest):"
    assert tables[2].startswith("| variant | plain: attack, round |") and "sum:" not in tables[2]
    title = tables.index(f"Setting `sum` (realistic; threat: {SECURE}):")
    assert tables[title + 2].startswith("| variant | sum: attack, round |")
    assert tables[title + 5].startswith("| `dp` | **failed** |") and len(tables) == title + 6


def test_the_strongest_attack_is_the_one_with_the_highest_mean_ssim(tmp_path: Path) -> None:
    [run] = load_sweep(write(tmp_path, SMALL + '[sweep]\n[sweep.variants.a]\n"seed" = 1\n'), tmp_path / "out").runs
    run.folder.mkdir(parents=True)
    rows = [
        {
            "attack": "ig",
            "status": "ok",
            "psnr": 20.0,
            "ssim": 0.5,
            "lpips": 0.3,
            "per_image": [{}],
            "leaked_images": 0,
            "floor": {"psnr": 15.0},
        },
        {
            "attack": "idlg",
            "status": "ok",
            "psnr": 35.0,
            "ssim": 0.95,
            "lpips": 0.05,
            "per_image": [{}],
            "leaked_images": 1,
            "floor": {"psnr": 15.0},
        },
        {
            "attack": "idlg",
            "status": "ok",
            "psnr": 25.0,
            "ssim": 0.85,
            "lpips": 0.15,
            "per_image": [{}],
            "leaked_images": 0,
            "floor": {"psnr": 17.0},
        },
        {"attack": "dlg", "status": "error", "psnr": None},
    ]
    (run.folder / "attacks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize_runs([run])
    assert summary["strongest_attack"] == "idlg" and set(summary["attacks"]) == {"ig", "idlg"}
    assert summary["psnr"] == 30.0 and summary["ssim"] == pytest.approx(0.9) and summary["floor_psnr"] == 16.0
    assert summary["leaked_images"] == 1 and summary["images"] == 2 and summary["accuracy"] is None


def test_the_table_shows_epsilon_and_raw_uploads_where_variants_report_them(tmp_path: Path) -> None:
    preset = write(tmp_path, SMALL + '[sweep]\n[sweep.variants.censor]\n"defense.name" = "censor"\n')
    [run] = load_sweep(preset, tmp_path / "out").runs
    run.folder.mkdir(parents=True)
    rounds = [
        {"round": 0, "accuracy": 0.1, "loss": 2.3, "seconds": 0.1},
        {
            "round": 1,
            "accuracy": 0.2,
            "loss": 2.0,
            "seconds": 1.0,
            "defense": {"raw": 0.5},
            "uploads": [{"client": 0, "raw": 1.0}, {"client": 1, "raw": 0.0}],
        },
        {
            "round": 2,
            "accuracy": 0.3,
            "loss": 1.9,
            "seconds": 1.0,
            "defense": {"raw": 0.0},
            "uploads": [{"client": 0, "raw": 0.0}, {"client": 1, "raw": 0.0}],
        },
    ]
    attacks = [
        {
            "attack": "ig",
            "status": "ok",
            "round": r,
            "client": c,
            "psnr": 20.0,
            "ssim": 0.5,
            "lpips": 0.3,
            "per_image": [{}],
            "leaked_images": 0,
        }
        for r, c in ((1, 0), (1, 1), (2, 0))
    ]
    attacks.append({**attacks[0], "attack": "idlg"})  # a second attack on the same upload counts once
    (run.folder / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    (run.folder / "attacks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in attacks))
    summary = summarize_runs([run])
    assert (summary["raw_fraction"], summary["raw_attacked"], summary["attacked_uploads"]) == (0.25, 1, 3)
    rows = [
        {**summary, "setting": "p"},
        {**summary, "setting": "u", "privacy": None},
        {"setting": "p", "variant": "dp", "epsilon": 2.1e6, "privacy": leak("ig", 5.0, 0.0, 0.4, 0.0), "rounds": 2},
        {"setting": "u", "variant": "dp-sgd", "epsilon": 6.34, "rounds": 2},
    ]
    table = summary_table(rows, "censor").splitlines()
    assert "| SSIM > 0.5 | accuracy | % of baseline | epsilon | raw uploads | s/round | u: accuracy |" in table[0]
    assert table[2].split(" | ")[9:12] == ["-", "1 of 3", "1.00"] and table[2].split(" | ")[14:16] == ["-", "25%"]
    assert table[3].split(" | ")[9:11] == ["2.1e+06", "-"] and table[4].split(" | ")[-3:-1] == ["6.34", "-"]


@pytest.mark.slow
def test_a_sweep_runs_each_variant_and_resumes(tmp_path: Path) -> None:
    preset = write(
        tmp_path,
        SMALL
        + IDLG_ROUND_1
        + """[sweep]
baseline = "none"
[sweep.variants.none]
"defense.name" = "none"
[sweep.variants.dp]
defense = { name = "dp", dp = { noise-multiplier = 0.05 } }
""",
    )
    sweep = load_sweep(preset, tmp_path / "out", ["train.rounds=2"], seeds=[0])
    lines: list[str] = []
    rows = run_sweep(sweep, lines.append, timeout=300)
    assert [r["status"] for r in rows] == ["ok", "ok"], lines
    assert all(r["rounds"] == 2 and 0 <= r["accuracy"] <= 1 for r in rows)
    summary = (tmp_path / "out" / SUMMARY_FILE).read_text()
    digest = hashlib.sha256(preset.read_bytes()).hexdigest()
    assert summary.startswith(
        f"Run as `fedguard sweep {preset} --seeds 0 --set train.rounds=2` (preset SHA-256 `{digest[:12]}`)"
    )
    assert summary.count("| `none` |") == summary.count("| `dp` |") == 2, summary  # the verdicts and the leakage
    recorded = json.loads((tmp_path / "out" / "invocation.json").read_text())
    assert recorded == {
        "preset": str(preset),
        "sha256": digest,
        "only": [],
        "seeds": [0],
        "overrides": ["train.rounds=2"],
    }
    page = html.unescape((tmp_path / "out" / "sweep.html").read_text())
    assert "--set train.rounds=2</code>" in page
    assert page.count("idlg, round 1, client 0, seed 0") == 2, "a strip per variant"
    assert page.count("the client's above, the reconstruction below") == 2 * 8, "each strip holds the batch of 8"
    links = re.findall(r'<a href="([^"]+/report\.html)">seed 0</a>', page)
    assert len(links) == 2 and all((tmp_path / "out" / link).is_file() for link in links), links
    if CHROMIUM.exists():  # the page as a browser shows it: every embedded image decodes
        url = (tmp_path / "out" / "sweep.html").resolve().as_uri()
        dom = chromium(["--virtual-time-budget=5000", "--dump-dom", url], tmp_path / "profile")
        assert dom.returncode == 0, dom.stderr[-2000:]
        loaded = re.search(r'data-images-loaded="(\d+)"', dom.stdout)
        assert loaded and int(loaded.group(1)) == img_count(page) > 2 * 2, "every figure and reconstruction decodes"
        assert "--set train.rounds=2" in html.unescape(dom.stdout)
    assert [json.loads(line)["variant"] for line in (tmp_path / "out" / SWEEP_FILE).read_text().splitlines()] == [
        "none",
        "dp",
    ]
    again: list[str] = []
    run_sweep(sweep, again.append)
    assert all("finished earlier, kept" in line for line in again), again


def test_a_sweep_preset_given_to_run_says_to_sweep_it(tmp_path: Path) -> None:
    preset = write(tmp_path, SMALL + '[sweep]\n[sweep.variants.a]\n"seed" = 1\n')
    with pytest.raises(ConfigError, match=r"describes a sweep of several runs .*`fedguard sweep .*sweep.toml`"):
        load_config(preset)


PAPER = (
    SMALL
    + """
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
)


def test_a_reproduction_preset_prints_the_papers_number_beside_ours(tmp_path: Path) -> None:
    sweep = load_sweep(write(tmp_path, PAPER), tmp_path / "out")
    assert sweep.paper is not None and [r.run for r in sweep.paper.rows] == ["run/dgp", "run/dgp", "run/none"]
    rows = [
        {"setting": "run", "variant": "none", "accuracy": 0.8},
        {
            "setting": "run",
            "variant": "dgp",
            "accuracy": 0.6,
            "by_round": {"1": {"ssim": 0.31}, "5": {"ssim": 0.12345}},
        },
    ]
    table = render_paper_table(sweep.paper, rows, "none").splitlines()
    assert table[0] == "## DGP (Xue et al.)"
    assert table[4] == "| accuracy kept | 99.1% (Table 2) | 75.0% | `run/dgp` | digits, 3 clients |"
    assert table[5] == "| IG SSIM at round 5 | 0.1 (Fig. 4) | 0.123 | `run/dgp` | MLP |"
    assert table[6] == "| upload share | 0.2 | not measured | `run/none` | - |"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ('run = "run/dgp"\nmetric = "accuracy_share"', "run 'run/dgpx' is not a <setting>/<variant> of this sweep"),
        ('format = "{:.1%}"', "format '{:.1q}' cannot print a number"),
        ('differs = "digits, 3 clients"', "paper row 1: missing 'differs'"),
    ],
)
def test_a_bad_paper_row_is_named(tmp_path: Path, change: str, message: str) -> None:
    broken = {
        'run = "run/dgp"\nmetric = "accuracy_share"': 'run = "run/dgpx"\nmetric = "accuracy_share"',
        'format = "{:.1%}"': 'format = "{:.1q}"',
        'differs = "digits, 3 clients"': "",
    }[change]
    with pytest.raises(ConfigError) as error:
        load_sweep(write(tmp_path, PAPER.replace(change, broken, 1)), tmp_path / "out")
    assert message in str(error.value)


SEEDED = (
    SMALL
    + """
[sweep]
baseline = "none"
seeds = [0, 1, 2]
[sweep.settings.privacy]
kind = "diagnostic"
[sweep.settings.fedavg]
kind = "realistic"
"train.batch-size" = 16
[sweep.variants.none]
"defense.name" = "none"
[sweep.variants.dp]
defense = { name = "dp", dp = { noise-multiplier = 0.5 } }
"""
)


def test_a_sweep_with_seeds_runs_each_cell_once_per_seed_in_a_folder_per_seed(tmp_path: Path) -> None:
    sweep = load_sweep(write(tmp_path, SEEDED), tmp_path / "out", ["train.rounds=3"], ["fedavg/dp"])
    assert sweep.seeds == (0, 1, 2)
    assert [(r.setting, r.variant, r.seed) for r in sweep.runs] == [("fedavg", "dp", s) for s in (0, 1, 2)]
    assert [r.folder for r in sweep.runs] == [tmp_path / "out" / "fedavg" / "dp" / f"seed-{s}" for s in (0, 1, 2)]
    assert all(
        r.config.train.rounds == 3 and r.config.train.batch_size == 16 and r.kind == "realistic" for r in sweep.runs
    )
    chosen = load_sweep(write(tmp_path, SEEDED), tmp_path / "out", only=["fedavg/dp"], seeds=[2])
    assert chosen.seeds == (2,) and [r.folder for r in chosen.runs] == [tmp_path / "out" / "fedavg" / "dp" / "seed-2"]
    plain = load_sweep(
        write(tmp_path, "seed = 4\n" + SMALL + "[sweep]\n[sweep.settings.s]\n[sweep.variants.a]\n"), tmp_path / "plain"
    )
    assert plain.seeds is None and [(r.seed, r.kind, r.folder) for r in plain.runs] == [
        (4, "diagnostic", tmp_path / "plain" / "s" / "a")
    ], "without seeds: the preset's seed, one folder per cell"


@pytest.mark.parametrize(
    ("change", "overrides", "message"),
    [
        ("seeds = [0, 0]", [], r"sweep.seeds = \[0, 0\]: give a list of distinct whole numbers >= 0, e.g. \[0, 1, 2\]"),
        ("seeds = []", [], r"sweep.seeds = \[\]: give a list"),
        ('seeds = ["1"]', [], r"sweep.seeds = \['1'\]: give a list"),
        ("seeds = [0, 1, 2]", ["seed=3"], r"sets each run's seed; remove seed from --set seed"),
        ('kind = "diagnostic"\n"seed" = 2', [], r"remove seed from \[sweep.settings.privacy\]"),
        ('kind = "practical"', [], r"sweep.settings.privacy.kind = 'practical': choose diagnostic or realistic"),
        (
            'kind = "diagnostic"\nvariants = ["none", "nope"]',
            [],
            r"sweep.settings.privacy.variants = \['none', 'nope'\]: give a list of variants of this sweep",
        ),
        ('kind = "diagnostic"\nvariants = []', [], r"sweep.settings.privacy.variants = \[\]: give a list"),
        (
            'kind = "diagnostic"\nvariants = ["none", "dp", "none"]',
            [],
            r"sweep.settings.privacy.variants = \['none', 'dp', 'none'\] names 'none' more than once; name each "
            r"variant once",
        ),
    ],
)
def test_bad_seeds_and_setting_kinds_are_named(tmp_path: Path, change: str, overrides: list[str], message: str) -> None:
    target = 'kind = "diagnostic"' if change.startswith("kind") else "seeds = [0, 1, 2]"
    assert target in SEEDED
    with pytest.raises(ConfigError, match=message):
        load_sweep(write(tmp_path, SEEDED.replace(target, change, 1)), tmp_path / "out", overrides)


def test_names_that_differ_only_in_case_are_refused_with_the_other_problems(tmp_path: Path) -> None:
    preset = write(
        tmp_path,
        SMALL
        + """
[sweep]
[sweep.settings.privacy]
[sweep.settings.Privacy]
[sweep.variants.dgp]
"defense.name" = "dgp"
[sweep.variants.DGP]
"defense.name" = "nope"
""",
    )
    with pytest.raises(ConfigError) as caught:
        load_sweep(preset, tmp_path / "out")
    problems = caught.value.problems
    clash = (
        "differ only in case, so their run folders would be one folder on a case-insensitive file system "
        "(macOS, Windows); rename them so that they differ in more than case"
    )
    assert problems[:2] == [
        f"{preset}: [sweep.settings.privacy] and [sweep.settings.Privacy] {clash}",
        f"{preset}: [sweep.variants.dgp] and [sweep.variants.DGP] {clash}",
    ]
    assert any(p.startswith("privacy/DGP: defense.name = 'nope'") for p in problems[2:]), problems


def test_an_only_given_twice_runs_each_run_once(tmp_path: Path) -> None:
    preset = write(tmp_path, SEEDED)
    twice = load_sweep(preset, tmp_path / "out", only=["fedavg/dp", "dp", "fedavg/dp"])
    assert [(r.setting, r.variant, r.seed) for r in twice.runs] == [
        (s, "dp", seed) for s in ("privacy", "fedavg") for seed in (0, 1, 2)
    ]


def finished_run(folder: Path, accuracy: float, ssims: list[float], seed: int, attack: str = "ig") -> None:
    """A run folder as ``fedguard run`` leaves it: two trained rounds and one scored upload of ``ssims``."""
    folder.mkdir(parents=True)
    rounds = [{"round": r, "accuracy": accuracy if r == 2 else 0.1, "loss": 1.0, "seconds": 1.0} for r in range(3)]
    per_image = [{"psnr": 10 + 20 * s, "ssim": s, "lpips": 1 - s} for s in ssims]
    attacks = [
        {
            "attack": attack,
            "status": "ok",
            "round": 1,
            "client": 0,
            "seed": seed,
            "psnr": 20.0,
            "ssim": sum(ssims) / len(ssims),
            "lpips": 0.3,
            "per_image": per_image,
            "leaked_images": 0,
        }
    ]
    (folder / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    (folder / "attacks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in attacks))
    write_status(folder, "completed", 2)


def test_a_cell_holds_its_seeds_statistics_and_leaves_a_failed_seed_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sweep = load_sweep(write(tmp_path, SEEDED), tmp_path / "out", [], ["privacy/none", "privacy/dp"])
    folders = {(r.variant, r.seed): r.folder for r in sweep.runs}
    for seed, accuracy in ((0, 0.8), (1, 0.9)):
        finished_run(folders["none", seed], accuracy, [0.9, 0.4], seed, "idlg")
    finished_run(folders["none", 2], 0.85, [0.95, 0.6], 2, "idlg")
    for seed in (0, 1):
        finished_run(folders["dp", seed], 0.4, [0.1, 0.2], seed)

    def fail(
        command: list[str], log: Path, timeout: float | None, env: dict[str, str] | None = None, append: bool = False
    ) -> int:
        log.write_text("Traceback ...\nRuntimeError: out of memory\n")
        return 1

    monkeypatch.setattr("fedguard.commands.sweep.run_one", fail)
    lines: list[str] = []
    rows = run_sweep(sweep, lines.append, share_ray=False)
    assert (
        lines[-1] == f"fedguard: [6/6] privacy/dp seed 2: failed: RuntimeError: out of memory "
        f"(log {folders['dp', 2]}.log)"
    )
    runs = [json.loads(line) for line in (tmp_path / "out" / "runs.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["seed"], r["status"]) for r in runs] == [
        ("none", 0, "ok"),
        ("none", 1, "ok"),
        ("none", 2, "ok"),
        ("dp", 0, "ok"),
        ("dp", 1, "ok"),
        ("dp", 2, "failed"),
    ]
    assert runs[0]["privacy"]["seeds"] == [0] and runs[0]["accuracy"] == 0.8
    assert rows == [json.loads(line) for line in (tmp_path / "out" / SWEEP_FILE).read_text().splitlines()]
    none, dp = rows
    assert (none["seeds"], none["failed_seeds"], dp["seeds"], dp["failed_seeds"]) == ([0, 1, 2], [], [0, 1], [2])
    assert none["setting_kind"] == "diagnostic" and none["folder"] == str(tmp_path / "out" / "privacy" / "none")
    assert none["threat"] == "honest" and runs[-1]["threat"] == "honest"
    assert none["accuracy"] == pytest.approx(0.85) and none["accuracy_share"] == 1.0
    assert none["accuracy_ci95"] == pytest.approx(
        [0.85 - 4.303 * 0.05 / 3**0.5, 0.85 + 4.303 * 0.05 / 3**0.5], abs=1e-4
    )
    assert (
        dp["accuracy"] == 0.4
        and dp["accuracy_ci95"] == [0.4, 0.4]
        and dp["accuracy_share"] == pytest.approx(0.4 / 0.85)
    )
    leak = none["privacy"]
    assert (leak["attack"], leak["adaptive"], leak["round"], leak["n_images"], leak["seeds"]) == (
        "idlg",
        False,
        1,
        6,
        [0, 1, 2],
    )
    assert leak["ssim_mean"] == pytest.approx(4.15 / 6) and leak["success_rate"] == pytest.approx(4 / 6)
    assert leak["recovered_rate"] == pytest.approx(1 / 6) and leak["success_threshold"] == 0.5
    assert [r["round"] for r in leak["per_round"]] == [1]
    summary = (tmp_path / "out" / SUMMARY_FILE).read_text()
    assert "| `none` | `idlg`, round 1 | 6 (3 seeds), not a verdict | 23.8 | 0.69 [" in summary
    assert f"- `privacy/dp` seed 2 **failed**: RuntimeError: out of memory (log {folders['dp', 2]}.log)" in summary


def test_a_cell_whose_every_seed_failed_is_a_failed_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = load_sweep(write(tmp_path, SEEDED.replace("[0, 1, 2]", "[0, 1]")), tmp_path / "out", [], ["privacy/dp"])
    monkeypatch.setattr("fedguard.commands.sweep.run_one", lambda command, log, timeout, env=None, append=False: 1)
    [row] = run_sweep(sweep, lambda line: None, share_ray=False)
    assert (row["status"], row["seeds"], row["failed_seeds"], row["accuracy"]) == ("failed", [], [0, 1], None)
    assert row["error"] == "seed 0: fedguard run exited with code 1; seed 1: fedguard run exited with code 1"
    assert "privacy" not in row and "seed" not in row
    assert "| `dp` | **failed** |\n" in (tmp_path / "out" / SUMMARY_FILE).read_text()


def test_a_malicious_cell_shows_the_manipulated_client_rounds_its_detectors_flagged(tmp_path: Path) -> None:
    variant = '[sweep]\n[sweep.variants.imprint]\n"threat.malicious" = "1:imprint"\n"attack.name" = "imprint"\n'
    variant += '"manipulation.imprint.bins" = 16\n"detect.name" = "structure, dsnr"\n"detect.action" = "report"\n'
    [run] = load_sweep(write(tmp_path, SMALL + variant), tmp_path / "out").runs
    finished_run(run.folder, 0.5, [0.95, 0.3], 0, "imprint")
    (run.folder / "config.toml").write_text(config_toml(run.config))
    rounds = [json.loads(line) for line in (run.folder / "rounds.jsonl").read_text().splitlines()]
    checks = {1: [True, False, False], 2: [True, True, False]}  # round 1 manipulated; round 2's flags are false alarms
    for row in rounds[1:]:
        row["detect"] = [
            {"client": c, "structure.flagged": flag, "dsnr.flagged": c == 1 and row["round"] == 1}
            for c, flag in enumerate(checks[row["round"]])
        ]
    (run.folder / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))

    summary = summarize_runs([run])

    assert (summary["detected"]["k"], summary["detected"]["n"]) == (2, 3)  # clients 0 and 1 of round 1
    table = summary_table([summary], "imprint")
    assert "| detected |" in table.splitlines()[0] and "| 2 of 3 (67%) |" in table
    assert "| 2, not a verdict |" in table, "2 images of 1 seed"
    honest = summarize_runs(
        [load_sweep(write(tmp_path, SMALL + "[sweep]\n[sweep.variants.a]\n"), tmp_path / "b").runs[0]]
    )
    assert honest["detected"] is None and "detected" not in summary_table([honest], "a")


def stopped_run(folder: Path, rounds: int, status: str | None, checkpoint: int | None) -> None:
    """A run folder as a killed run leaves it: ``rounds`` rounds logged, ``status`` (None: none written) and a
    checkpoint after round ``checkpoint`` (None: none)."""
    folder.mkdir(parents=True)
    rows = [{"round": r, "accuracy": 0.1, "loss": 1.0, "seconds": 1.0} for r in range(rounds + 1)]
    (folder / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    folder.with_suffix(".log").write_text("the first lines\n")
    if status is not None:
        write_status(folder, status, rounds)
    if checkpoint is not None:
        write_checkpoint(folder, RoundCheckpoint(checkpoint, ("w",), [np.zeros(2)]))


def test_a_stopped_sweep_resumes_a_checkpointed_run_and_sets_aside_one_it_cannot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    preset = write(tmp_path, SMALL + "[sweep]\n[sweep.variants.a]\n[sweep.variants.b]\n[sweep.variants.c]\n")
    sweep = load_sweep(preset, tmp_path / "out", ["train.rounds=3"])
    folders = {run.variant: run.folder for run in sweep.runs}
    stopped_run(folders["a"], 2, "interrupted", 2)  # killed in round 3: goes on after round 2
    stopped_run(folders["b"], 0, None, None)  # killed in round 1, so hard that no status was written
    stopped_run(folders["c"], 3, "interrupted", 3)  # killed while attacking after its last round: not finished
    commands: list[list[str]] = []

    def run(
        command: list[str], log: Path, timeout: float | None, env: dict[str, str] | None = None, append: bool = False
    ) -> int:
        commands.append(command)
        assert append == ("--resume" in command), "a resumed run's log goes on after its first lines"
        folder = Path(command[command.index("--resume" if append else "--out") + 1])
        rows = [{"round": r, "accuracy": 0.5, "loss": 1.0, "seconds": 1.0} for r in range(4)]
        (folder / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        write_status(folder, "completed", 3)
        return 0

    monkeypatch.setattr("fedguard.commands.sweep.run_one", run)
    lines: list[str] = []
    rows = run_sweep(sweep, lines.append, share_ray=False)
    assert [command[3:] for command in commands] == [
        ["run", "--resume", str(folders["a"])],
        ["run", "--plan", str(folders["b"].with_suffix(".plan.json")), "--out", str(folders["b"])],
        ["run", "--plan", str(folders["c"].with_suffix(".plan.json")), "--out", str(folders["c"])],
    ]
    for variant in ("b", "c"):  # each run is the configuration the sweep validated
        plan = folders[variant].with_suffix(".plan.json").read_text()
        assert Config.from_plan(plan) == next(r.config for r in sweep.runs if r.folder == folders[variant])
    assert "fedguard: [1/3] run/a: stopped after round 2 of 3; resuming it" in lines
    for variant in ("b", "c"):
        aside = folders[variant].with_name(f"{variant}.stopped-1")
        moved = f"an unfinished run was in its folder; moved to {aside}, run again"
        assert f"fedguard: [{'abc'.index(variant) + 1}/3] run/{variant}: {moved}" in lines
        assert (aside / "rounds.jsonl").is_file() and aside.with_suffix(".log").read_text() == "the first lines\n"
    assert not any("finished earlier" in line for line in lines), lines
    assert [row["accuracy"] for row in rows] == [0.5, 0.5, 0.5]


def test_a_run_still_written_by_another_process_is_not_raced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = load_sweep(write(tmp_path, SMALL + "[sweep]\n[sweep.variants.a]\n"), tmp_path / "out", ["train.rounds=3"])
    [run] = sweep.runs
    stopped_run(run.folder, 1, None, 1)
    monkeypatch.setattr("fedguard.commands.sweep.STOPPED_WAIT", 0.3)
    monkeypatch.setattr("fedguard.commands.sweep.run_one", lambda *args, **kwargs: pytest.fail("raced the writer"))
    lock = hold(run.folder)  # the watcher of a killed run, still stopping it
    try:
        [row] = run_sweep(sweep, lambda line: None, share_ray=False)
    finally:
        os.close(lock)
    assert row["status"] == "failed" and row["error"] == f"{run.folder} is still written by another process after 0 s"
    assert read_status(run.folder) is None and (run.folder / "rounds.jsonl").is_file(), "left as it was"
