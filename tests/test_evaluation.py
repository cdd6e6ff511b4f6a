"""The vault, the evaluator, and the offline attack command."""

from __future__ import annotations

import dataclasses
import html
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fedguard
from attackers.base import AttackOutcome, Reconstruction
from fedguard.api import open_run
from fedguard.commands.cli import main
from fedguard.config import load_config
from fedguard.data import load_dataset
from fedguard.evaluation import Evaluator, describe_row
from fedguard.metrics import psnr, ssim
from fedguard.models import build_model
from fedguard.observation import ModelCard
from fedguard.store.folder import ATTACKS_FILE, VAULT_DIR
from fedguard.store.observation_files import save_observation
from fedguard.store.run_dir import OBSERVATIONS_DIR, prepare_run_dir
from fedguard.store.vault import read_truth, write_truth
from fedguard.training import compute_gradients, get_arrays, merge_by_mask, split_by_mask, trainable_mask


def test_vault_round_trip(tmp_path: Path) -> None:
    images, labels = torch.rand(3, 1, 5, 5), torch.tensor([2, 0, 2])
    write_truth(tmp_path, 4, 7, images, labels)
    got = read_truth(tmp_path, 4, 7)
    assert got is not None and torch.equal(got[0], images) and torch.equal(got[1], labels)
    assert read_truth(tmp_path, 4, 8) is None


def make_run(tmp_path: Path, batch: int = 2, clients: int = 2) -> Path:
    """A run folder as a simulation leaves it: config, captured MLP gradients of photos, the vault."""
    config = load_config(None, ["data.name=photos", f"out-dir={tmp_path / 'run'}", "model.mlp.hidden=32"])
    folder = prepare_run_dir(config)
    data = load_dataset("photos")
    torch.manual_seed(0)
    model = build_model("mlp", data.spec, config.model.params)
    arrays, mask = get_arrays(model), trainable_mask(model)
    card = ModelCard("mlp", dataclasses.asdict(config.model.params), data.spec, tuple(model.state_dict()), tuple(mask))
    for client in range(clients):
        x, y = data.test.batch(np.arange(batch) + 50 * client)
        grads, _ = compute_gradients(model, x, y)
        upload = merge_by_mask([g.numpy() for g in grads], split_by_mask(arrays, mask)[1], mask)
        save_observation(
            card.observe(1, client, "gradient", arrays, upload, batch, {"batch-size": batch}), folder / OBSERVATIONS_DIR
        )
        write_truth(folder / VAULT_DIR, 1, client, x, y)
    (folder / "rounds.jsonl").write_text('{"round": 0, "accuracy": 0.1, "loss": 2.3, "seconds": 0.1}\n')
    return folder


def test_evaluator_scores_after_matching_and_writes_grids(tmp_path: Path) -> None:
    folder = make_run(tmp_path, batch=3, clients=1)
    truth = read_truth(folder / VAULT_DIR, 1, 0)
    assert truth is not None
    images, labels = truth
    from fedguard.store.observation_files import load_observations

    [obs] = load_observations(folder / OBSERVATIONS_DIR)
    shuffled = Reconstruction(images[[2, 0, 1]], labels[[2, 0, 1]], {"loss": 0.0})
    evaluator = Evaluator(folder, {"ig": {"attack": "ig", "defense": "none", "seed": 0}})
    row = evaluator(AttackOutcome(obs, "ok", shuffled, seconds=1.5, attack="ig"))
    assert row["psnr"] == pytest.approx(100.0) and row["ssim"] == pytest.approx(1.0) and row["label_accuracy"] == 1.0
    assert row["mse"] == 0.0 and row["batch_size"] == 3 and row["status"] == "ok"
    assert (folder / f"{row['images']}_truth.png").is_file() and (folder / f"{row['images']}_recon.png").is_file()
    assert row["leaked_images"] == 3 and [image["psnr"] for image in row["per_image"]] == [100.0] * 3
    flat = images.mean((2, 3), keepdim=True).expand_as(images)
    assert row["floor"]["psnr"] == pytest.approx(float(psnr(flat, images).mean()))
    assert row["floor"]["ssim"] == pytest.approx(float(ssim(flat, images).mean()))
    noisy = Reconstruction(torch.rand_like(images), labels, {})
    worse = evaluator(AttackOutcome(obs, "ok", noisy, attack="ig"))
    assert worse["psnr"] < 15 and worse["ssim"] < 0.3 and worse["leaked_images"] == 0
    assert describe_row(row).startswith("ig round 1 client 0: ok (1.5 s) PSNR 100.00 dB (flat-image floor ")
    assert describe_row(row).endswith("SSIM 1.000 (best image 1.000), 3 of 3 images above SSIM 0.9")
    failed = evaluator(AttackOutcome(obs, "timeout", error="no result within 5 s", attack="ig"))
    assert describe_row(failed) == "ig round 1 client 0: timeout (0.0 s) no result within 5 s"
    assert failed["psnr"] is None and failed["error"] == "no result within 5 s"
    rows = [json.loads(line) for line in (folder / ATTACKS_FILE).read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok", "ok", "timeout"]
    assert {
        "round",
        "client",
        "attack",
        "defense",
        "batch_size",
        "mse",
        "psnr",
        "ssim",
        "lpips",
        "label_accuracy",
        "seconds",
        "seed",
        "status",
    } <= rows[0].keys()


def test_missing_ground_truth_is_reported_not_scored(tmp_path: Path) -> None:
    folder = make_run(tmp_path, batch=1, clients=1)
    (folder / VAULT_DIR / "round-0001_client-0000.npz").unlink()
    from fedguard.store.observation_files import load_observations

    [obs] = load_observations(folder / OBSERVATIONS_DIR)
    row = Evaluator(folder, {"ig": {"attack": "ig"}})(
        AttackOutcome(obs, "ok", Reconstruction(torch.rand(1, 3, 32, 32), torch.tensor([0])), attack="ig")
    )
    assert row["psnr"] is None and "no ground truth" in row["error"]


def test_attack_command_on_a_capture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = make_run(tmp_path, batch=1)
    code = main(
        [
            "attack",
            str(folder / OBSERVATIONS_DIR),
            "--set",
            "attack.name=ig",
            "--set",
            "attack.ig.iterations=150",
            "--set",
            "attack.ig.restarts=1",
            "--set",
            "attack.ig.device=cpu",
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in (folder / ATTACKS_FILE).read_text().splitlines()]
    assert len(rows) == 2 and all(r["status"] == "ok" and r["source"] == "offline" for r in rows)
    assert {r["invocation"] for r in rows} == {"attack-1"}
    assert all(r["psnr"] > 20 and r["label_accuracy"] == 1.0 for r in rows), rows
    assert (folder / "report.html").is_file()
    assert "ig round 1 client 0: ok" in capsys.readouterr().out


def test_attack_command_names_missing_attack_files_before_any_attack_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = make_run(tmp_path, batch=1, clients=1)
    absent = tmp_path / "no-generator.npz"
    code = main(["attack", str(folder), "--set", "attack.name=ig,ggl", "--set", f"attack.ggl.generator={absent}"])
    assert code == 2
    assert f"attack.ggl.generator = {str(absent)!r}: no generator" in capsys.readouterr().err
    assert not (folder / ATTACKS_FILE).exists()


def test_attack_command_needs_an_attack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = make_run(tmp_path, clients=1)
    assert main(["attack", str(folder)]) == 2
    assert "choose attacks" in capsys.readouterr().err
    assert main(["attack", str(tmp_path / "nothing"), "--set", "attack.name=ig"]) == 2
    assert "no captured observations" in capsys.readouterr().err


def test_attack_command_runs_on_a_plugin_run_where_its_plugins_cannot_be_imported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plugin defense, detector and manipulation are left out and named; the built-in model stays; the
    captured uploads are attacked. A plugin model cannot be left out: refused, naming it."""
    import tomllib

    import tomli_w

    folder = make_run(tmp_path, clients=2)
    recorded = tomllib.loads((folder / "config.toml").read_text())
    recorded["server"]["plugins"] = "lab_plugins.sign_flip"  # importable only in the lab's own folder
    recorded["defense"] = {"name": "sign-flip", "sign-flip": {"scale": 2.5}}
    recorded["detect"] = {**recorded.get("detect", {}), "name": "structure, lab-check", "lab-check": {"k": 3}}
    recorded["threat"] = {**recorded.get("threat", {}), "malicious": "4:lab-bins"}
    recorded["manipulation"] = {"lab-bins": {"bins": 8}}
    (folder / "config.toml").write_text(tomli_w.dumps(recorded))
    ig = ["--set", "attack.name=ig", "--set", "attack.ig.iterations=5", "--set", "attack.ig.device=cpu"]
    assert main(["attack", str(folder), *ig]) == 0
    out = capsys.readouterr().out
    left_out = "fedguard: server.plugins = 'lab_plugins.sign_flip' cannot be imported here; left out:"
    assert f"{left_out} defense 'sign-flip' (the attacks treat the uploads as undefended" in out, out
    assert f"{left_out} detect 'lab-check'" in out and f"{left_out} manipulation 'lab-bins'" in out
    assert "detect 'structure'" not in out and "ig on 2 of 2 observations" in out
    rows = [json.loads(line) for line in (folder / ATTACKS_FILE).read_text().splitlines()]
    assert [(row["client"], row["status"]) for row in rows] == [(0, "ok"), (1, "ok")]

    recorded["model"] = {"name": "lab-net"}
    (folder / "config.toml").write_text(tomli_w.dumps(recorded))
    assert main(["attack", str(folder), *ig]) == 2
    assert "model.name = 'lab-net' comes from server.plugins = 'lab_plugins.sign_flip'" in capsys.readouterr().err


def test_labels_an_attack_does_not_know_are_not_scored(tmp_path: Path) -> None:
    folder = make_run(tmp_path, batch=3, clients=1)
    truth = read_truth(folder / VAULT_DIR, 1, 0)
    assert truth is not None
    from fedguard.store.observation_files import load_observations

    [obs] = load_observations(folder / OBSERVATIONS_DIR)
    unknown = Reconstruction(truth[0][[2, 0, 1]], torch.full((3,), -1), {})  # -1: labels the attack does not know
    row = Evaluator(folder, {})(AttackOutcome(obs, "ok", unknown, attack="feature-fishing"))
    assert row["label_accuracy"] is None and row["ssim"] == pytest.approx(1.0)


IG_CPU = ["attack.name=ig", "attack.ig.restarts=1", "attack.ig.device=cpu"]


def cli_attack(folder: Path, *overrides: str) -> None:
    assert main(["attack", str(folder), *(arg for text in overrides for arg in ("--set", text))]) == 0


def test_two_attack_invocations_with_different_budgets_stay_apart(tmp_path: Path) -> None:
    folder = make_run(tmp_path, batch=1, clients=1)
    cli_attack(folder, *IG_CPU, "attack.ig.iterations=2")
    cli_attack(folder, *IG_CPU, "attack.ig.iterations=150")
    rows = [json.loads(line) for line in (folder / ATTACKS_FILE).read_text().splitlines()]
    assert [(r["invocation"], r["attack_params"]["iterations"]) for r in rows] == [("attack-1", 2), ("attack-2", 150)]
    assert rows[0]["images"] != rows[1]["images"] and rows[1]["psnr"] > rows[0]["psnr"] + 5
    run = open_run(folder)
    latest = run.images("ig", 1, 0)[1]
    first = run.images("ig", 1, 0, invocation="attack-1")[1]
    stored = {r["invocation"]: np.load(folder / f"{r['images']}_recon.npz")["images"] for r in rows}
    assert np.array_equal(latest, stored["attack-2"]) and np.array_equal(first, stored["attack-1"])
    with pytest.raises(KeyError, match=r"invocation 'attack-3'.*\('ig', 1, 0, 'attack-1'\)"):
        run.images("ig", 1, 0, invocation="attack-3")
    report = (folder / "report.html").read_text()
    assert "ig (attack-1)" in report and "ig (attack-2)" in report


def test_the_python_attack_gives_the_rows_of_the_command_in_this_process(tmp_path: Path) -> None:
    import psutil

    by_cli, by_api = make_run(tmp_path / "cli", batch=1, clients=1), make_run(tmp_path / "api", batch=1, clients=1)
    cli_attack(by_cli, *IG_CPU, "attack.ig.iterations=40")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    rows = fedguard.attack(by_api, "ig", iterations=40, restarts=1, device="cpu", progress=None)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before  # no Flower or Ray process
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    [expected] = [json.loads(line) for line in (by_cli / ATTACKS_FILE).read_text().splitlines()]
    [got] = rows.to_dict("records")
    for key in ("attack", "invocation", "round", "client", "status", "psnr", "ssim", "lpips", "label_accuracy"):
        assert got[key] == expected[key], key
    assert got["attack_params.iterations"] == 40


def test_the_report_shows_aligned_pairs_with_their_scores_and_marks_an_attack_below_the_floor(tmp_path: Path) -> None:
    from fedguard.report.html import build_report
    from fedguard.store.observation_files import load_observations

    folder = make_run(tmp_path, batch=3, clients=2)
    truth = read_truth(folder / VAULT_DIR, 1, 0)
    assert truth is not None
    images, labels = truth
    first, second = load_observations(folder / OBSERVATIONS_DIR)
    evaluator = Evaluator(folder, {"ig": {"attack": "ig", "defense": "none", "seed": 0}})
    exact = evaluator(AttackOutcome(first, "ok", Reconstruction(images[[2, 0, 1]], labels[[2, 0, 1]]), attack="ig"))
    assert exact["psnr"] == pytest.approx(100.0)
    grey = Reconstruction(torch.full((3, 3, 32, 32), 0.5), torch.tensor([0, 1, 2]))
    flat = evaluator(AttackOutcome(second, "ok", grey, attack="ig"))
    assert flat["psnr"] < flat["floor"]["psnr"]
    page = html.unescape(build_report(folder).read_text())
    assert page.count('<div class="pairs"') == 2 and page.count("the client's above, the reconstruction below") == 6
    assert page.count("SSIM 1.00 · 100.0 dB") == 3  # the exact copy, each image matched to its own
    assert page.count(">below the floor</span>") == 2  # its gallery title and its row; not on the exact one
    assert "median PSNR (dB)" in page
