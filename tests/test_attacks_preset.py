"""The attacks preset end to end: a Ray simulation whose honest and malicious rounds feed every attack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attackers import ATTACKS
from fedguard.config import load_config
from fedguard.data.spec import DataSpec
from fedguard.generators import TrainedGenerator, TrainOptions, save_generator, train_vae

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "experiments" / "attacks.toml"
# The preset's attacks, cut to a few iterations: this checks the plumbing and the analytic attacks, whose
# results do not depend on iterations; the optimization attacks' scores are tested in their own files.
SHORT = ["attack.ig.iterations=10", "attack.ig.restarts=1", "attack.dlg.iterations=3", "attack.dlg.restarts=1",
         "attack.idlg.iterations=3", "attack.idlg.restarts=1", "attack.gradinversion.iterations=10",
         "attack.gradinversion.restarts=2", "attack.ggl.iterations=10", "attack.ggl.restarts=1", "pool.workers=1"]


@pytest.mark.slow
def test_attacks_preset_writes_one_row_per_attack_and_recovers_trapped_inputs(tmp_path: Path) -> None:
    decoder, losses = train_vae(torch.rand(16, 1, 28, 28), DataSpec(1, 28, 28, 10), TrainOptions(epochs=1, width=8))
    generator = save_generator(TrainedGenerator(decoder, "mnist-5k", "test", tuple(losses)), tmp_path / "g.npz")
    overrides = [*SHORT, f"attack.ggl.generator={generator}"]
    out = tmp_path / "run"
    command = [sys.executable, "-m", "fedguard", "run", str(PRESET), "--out", str(out)]
    for override in overrides:
        command += ["--set", override]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    names = load_config(PRESET, overrides).attack_names()
    single = {name for name in ATTACKS.names() if "+" not in name}  # mjolnir+<attack> has its own preset
    assert set(names) == single, "the preset must run every registered attack"
    rows = [json.loads(line) for line in (out / "attacks.jsonl").read_text().splitlines()]
    assert sorted(r["attack"] for r in rows) == sorted(names)
    assert all(r["status"] == "ok" and r["psnr"] is not None and r["floor"]["psnr"] > 0 for r in rows), rows
    by_attack = {r["attack"]: r for r in rows}
    assert {r["manipulation"] for r in rows} == {"none", "trap-weights", "imprint"}
    for analytic in ("trap-weights", "imprint"):
        row = by_attack[analytic]
        recovered = row["stats"]["recovered"]
        assert recovered >= 2, row["stats"]
        exact = sorted((image["psnr"] for image in row["per_image"]), reverse=True)[:recovered]
        assert min(exact) > 40, row["per_image"]
    report = (out / "report.html").read_text()
    assert all(name in report for name in names)
