"""The shipped presets as the documentation runs them: trained files made with the documented commands, every path
in the presets relative, the commands typed in a folder that is not the app's (the simulation's processes start in
folders of their own). Quick forms: few rounds, few iterations, one or two variants of each sweep."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attackers import ATTACKS
from attackers.base import attack_traits
from fedguard.config import BUILT_IN_PACKAGES, Config, load_config
from fedguard.data.registry import dataset_spec
from fedguard.models import build_model

ROOT = Path(__file__).resolve().parents[1]
QUICK_ATTACKS = [
    "attack.ig.iterations=10",
    "attack.ig.restarts=1",
    "attack.idlg.iterations=10",
    "attack.idlg.restarts=1",
    "attack.dlg.iterations=10",
    "attack.dlg.restarts=1",
]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def fedguard(folder: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """``fedguard ARGS`` typed in ``folder``; fails the test with its output when it exits non-zero."""
    result = subprocess.run(
        [sys.executable, "-m", "fedguard", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, f"fedguard {' '.join(args)}:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


def sweep(folder: Path, preset: str, only: list[str], overrides: list[str], seeds: str = "") -> list[dict]:
    """The rows of ``fedguard sweep PRESET --only ... --set ... [--seeds SEEDS]`` typed in ``folder``."""
    args = ["sweep", preset, "--out", "sweep-" + Path(preset).stem] + (["--seeds", seeds] if seeds else [])
    for name in only:
        args += ["--only", name]
    for override in overrides:
        args += ["--set", override]
    fedguard(folder, *args)
    return [json.loads(line) for line in (folder / args[3] / "sweep.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's folder: the checkout's presets under experiments/, evaluation networks and a generator made there
    by the documented commands (tiny: one epoch, narrow), so that the presets' relative paths find them."""
    folder = tmp_path_factory.mktemp("lab")
    (folder / "experiments").symlink_to(ROOT / "experiments")
    for data in ("photos", "mnist-5k"):
        fedguard(folder, "train-evalnet", "--data", data, "--epochs", "1", "--mixes", "1", "--width", "4")
    fedguard(folder, "train-generator", "--data", "mnist-5k", "--epochs", "1")
    return folder


@pytest.mark.heavy
def test_the_defenses_sweep_runs_refiner_with_the_presets_relative_evaluation_networks(lab: Path) -> None:
    rows = sweep(
        lab,
        "experiments/defenses.toml",
        ["refiner"],
        [
            "train.rounds=2",
            "capture.rounds=1,2",
            *QUICK_ATTACKS,
            "attack.ig-adaptive.iterations=10",
            "attack.ig-adaptive.restarts=1",
        ],
        seeds="0,1",
    )
    assert [(r["setting"], r["variant"]) for r in rows] == [("trained", "refiner")]
    (row,) = rows
    assert row["status"] == "ok" and row["accuracy"] is not None and row["rounds"] == 2, row
    leak = row["privacy"]
    assert leak["seeds"] == [0, 1] and leak["n_images"] == 32, "2 clients x 8 images x 2 seeds"
    assert [r["round"] for r in leak["per_round"]] == [1, 2]
    assert row["defense_report"], "Refiner reports on every upload"
    assert "ig-adaptive" in row["attacks"]
    summary = (lab / "sweep-defenses" / "summary.md").read_text()
    assert "`refiner`" in summary and "failed" not in summary


def test_the_defenses_sweeps_realistic_settings_run_in_a_quick_form(lab: Path) -> None:
    """One round, one seed, the optimization attacks at 10 iterations: the realistic MLP under pruning (honest,
    the span attacks that know it), the CNN, the malicious server with the clients' detectors on, and the same
    server under secure aggregation, each row naming its threat model and setting kind."""
    rows = sweep(
        lab,
        "experiments/defenses.toml",
        ["realistic/prune", "realistic-conv/none", "realistic-malicious/none", "realistic-secure/none"],
        [
            "train.rounds=1",
            "capture.rounds=1",
            *QUICK_ATTACKS,
            "attack.ig-adaptive.iterations=10",
            "attack.ig-adaptive.restarts=1",
            "attack.fedavg-inversion.iterations=10",
        ],
        seeds="0",
    )
    by = {(r["setting"], r["variant"]): r for r in rows}
    assert all(r["status"] == "ok" and r["setting_kind"] == "realistic" for r in rows), rows
    pruned = by["realistic", "prune"]
    assert pruned["threat"] == "honest"
    assert set(pruned["attacks"]) == {"ig-adaptive", "fc-span", "fc-span-adaptive"}
    assert pruned["attacks"]["fc-span-adaptive"]["ssim"] > pruned["attacks"]["fc-span"]["ssim"] + 0.2
    assert pruned["privacy"]["attack"] == "fc-span-adaptive" and pruned["privacy"]["adaptive"]
    assert set(by["realistic-conv", "none"]["attacks"]) == {"ig", "fedavg-inversion"}
    malicious = by["realistic-malicious", "none"]
    assert malicious["threat"] == "malicious" and set(malicious["attacks"]) == {"imprint"}
    caught = malicious["detected"]
    assert caught is not None and caught["n"] == 10 and caught["k"] == 10, "every client of the round flags imprint"
    assert by["realistic-secure", "none"]["threat"] == "malicious, secure aggregation"


@pytest.mark.parametrize(
    "preset, variant",
    [
        ("censor", "trained/censor"),
        pytest.param("dgp", "imprint/dgp", marks=pytest.mark.heavy),
        pytest.param("refiner", "photos/refiner", marks=pytest.mark.heavy),
        pytest.param("soteria", "trained/soteria-60", marks=pytest.mark.heavy),
    ],
)
def test_each_paper_preset_runs_from_the_users_folder(lab: Path, preset: str, variant: str) -> None:
    quick = ["train.rounds=1", "capture.rounds=1", *QUICK_ATTACKS]
    if preset != "dgp":  # the adaptive IG attacks there too (DGP's variant here is the imprint server's)
        quick += ["attack.ig-adaptive.iterations=10", "attack.ig-adaptive.restarts=1"]
    rows = sweep(lab, f"experiments/papers/{preset}.toml", [variant], quick, seeds="0")
    assert [r["status"] for r in rows] == ["ok"], rows
    assert rows[0]["images"] >= 1 and rows[0]["psnr"] is not None


@pytest.mark.heavy
def test_the_mjolnir_paper_preset_runs_with_its_relative_denoiser(lab: Path) -> None:
    # The documented command, at its smallest: the digits' own public split instead of Fashion-MNIST's (10x fewer
    # surrogate steps), 16 gradients, one epoch.
    fedguard(
        lab,
        "train-mjolnir",
        "--set",
        "data.name=mnist-5k",
        "--set",
        "model.name=lenet",
        "--set",
        "train.batch-size=1",
        "--surrogate-data",
        "mnist-5k",
        "--surrogate-lr",
        "0",
        "--surrogate-epochs",
        "1",
        "--gradients",
        "16",
        "--epochs",
        "1",
        "--unet",
        "cpu",
        "--out",
        "mjolnir/fashion-mnist-lenet.npz",
    )
    rows = sweep(
        lab,
        "experiments/papers/mjolnir.toml",
        ["epsilon-1"],
        ["attack.mjolnir+dlg.iterations=4", "attack.mjolnir+dlg.restarts=1", *QUICK_ATTACKS],
    )
    assert [r["status"] for r in rows] == ["ok"], rows
    assert "mjolnir+dlg" in rows[0]["attacks"]


@pytest.mark.heavy
def test_the_attacks_preset_runs_every_attack_with_the_generator_the_readme_trains(lab: Path) -> None:
    # The preset's attacks cut to a few iterations: this checks the plumbing and the analytic attacks, whose
    # results do not depend on iterations; the optimization attacks' scores are tested in their own files.
    overrides = [
        *QUICK_ATTACKS,
        "attack.ig-adaptive.iterations=10",
        "attack.ig-adaptive.restarts=1",
        "attack.gradinversion.iterations=10",
        "attack.gradinversion.restarts=2",
        "attack.ggl.iterations=10",
        "attack.ggl.restarts=1",
        "pool.workers=1",
    ]
    fedguard(
        lab,
        "run",
        "experiments/attacks.toml",
        "--out",
        "attacks",
        *itertools.chain.from_iterable(["--set", o] for o in overrides),
    )
    out = lab / "attacks"
    assert f'generator = "{lab / "generators" / "mnist-5k.npz"}"' in (out / "config.toml").read_text(), (
        "config.toml records the path resolved where the command ran"
    )
    config = load_config(ROOT / "experiments" / "attacks.toml", overrides)
    names = config.attack_names()
    single = {
        entry.name
        for entry in ATTACKS.entries()  # mjolnir+<attack> has its own preset; a plugin another
        if "+" not in entry.name and entry.factory.__module__.split(".")[0] in BUILT_IN_PACKAGES
    }  # test loaded
    assert set(names) == single - refusing(config), "the preset must run every registered attack its model allows"
    rows = [json.loads(line) for line in (out / "attacks.jsonl").read_text().splitlines()]
    assert sorted(r["attack"] for r in rows) == sorted(names)
    assert all(r["status"] == "ok" and r["psnr"] is not None and r["floor"]["psnr"] > 0 for r in rows), rows
    by_attack = {r["attack"]: r for r in rows}
    assert {r["manipulation"] for r in rows} == {"none", "trap-weights", "imprint", "imprint-hidden"}
    for analytic in ("trap-weights", "imprint", "imprint-hidden"):
        row = by_attack[analytic]
        recovered = row["stats"]["recovered"]
        assert recovered >= 2, row["stats"]
        exact = sorted((image["psnr"] for image in row["per_image"]), reverse=True)[:recovered]
        assert min(exact) > 40, row["per_image"]
    report = (out / "report.html").read_text()
    assert all(name in report for name in names)


def refusing(config: Config) -> set[str]:
    """The registered attacks whose ``check_model`` refuses the model of ``config`` (fishing: a BatchNorm1d)."""
    spec = dataset_spec(config.data.name, config.data.source_options())
    assert spec is not None
    with torch.device("meta"):
        model = build_model(config.model.name, spec, config.model.params)
    refused = set()
    for name in ATTACKS.names():
        check = attack_traits(name).check_model
        try:
            if check is not None:
                check(model)
        except ValueError:
            refused.add(name)
    return refused


def test_a_run_whose_clients_cannot_load_their_file_fails_at_once_naming_it(lab: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedguard",
            "run",
            "experiments/quickstart.toml",
            "--set",
            "defense.name=refiner",
            "--set",
            "defense.refiner.evalnet=none.npz",
        ],
        cwd=lab,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 2
    assert f"no evaluation network at {lab / 'none.npz'}" in result.stderr
