"""The Python API: a configuration from a path, a mapping or a Config; a run's and a sweep's folders as
DataFrames and arrays; and one run started from Python whose arrays are the ones it scored, tracked to
TensorBoard and MLflow as it went."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import fedguard
from fedguard.config import ConfigError, load_config
from fedguard.metrics.image import psnr
from fedguard.store.vault import write_batch, write_truth

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "experiments" / "quickstart.toml"


def jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_a_configuration_is_a_path_a_flat_or_nested_mapping_or_a_config() -> None:
    from_path = fedguard.as_config(QUICKSTART, ["train.rounds=3"])
    assert from_path == load_config(QUICKSTART, ["train.rounds=3"])
    nested = fedguard.as_config({"train": {"rounds": 2}, "partition.num-clients": 3}, ["train.clients-per-round=3"])
    assert (nested.train.rounds, nested.partition.num_clients, nested.train.clients_per_round) == (2, 3, 3)
    assert fedguard.as_config(nested) == nested
    assert fedguard.as_config(nested, ["train.rounds=4"]).train.rounds == 4
    with pytest.raises(ConfigError, match="unknown key 'train.roundz'; did you mean train.rounds"):
        fedguard.as_config({"train.roundz": 2})
    with pytest.raises(ConfigError, match="config int: give a preset's path, a mapping of keys or a Config"):
        fedguard.as_config(3)  # type: ignore[arg-type]


def fake_run(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """A run folder as ``fedguard run`` leaves it: two rounds, one CENSOR-like upload report, one scored attack
    on client 1 of round 1 with its truth in the vault and its reconstruction's arrays; returns both batches."""
    truth = torch.rand(3, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    recon = truth.flip(0)
    jsonl(
        folder / "rounds.jsonl",
        [
            {"round": 0, "accuracy": 0.1, "loss": 2.3, "seconds": 0.2},
            {
                "round": 1,
                "accuracy": 0.4,
                "loss": 1.9,
                "seconds": 1.5,
                "defense": {"raw": 0.5},
                "uploads": [{"client": 0, "raw": 1.0}, {"client": 1, "raw": 0.0}],
            },
        ],
    )
    jsonl(
        folder / "attacks.jsonl",
        [
            {
                "round": 1,
                "client": 1,
                "attack": "ig",
                "defense": "none",
                "status": "ok",
                "psnr": 30.0,
                "ssim": 0.9,
                "lpips": 0.1,
                "attack_params": {"iterations": 5},
                "images": "images/round-0001_client-0001_ig",
                "per_image": [{"psnr": 29.0, "ssim": 0.8}, {"psnr": 30.0, "ssim": 0.9}, {"psnr": 31.0, "ssim": 1.0}],
            },
            {"round": 1, "client": 0, "attack": "idlg", "status": "error", "psnr": None, "images": None},
        ],
    )
    write_truth(folder / "vault", 1, 1, truth, torch.tensor([1, 2, 3]))
    write_batch(folder / "images" / "round-0001_client-0001_ig_recon.npz", recon, torch.tensor([3, 2, 1]))
    return truth, recon


def test_a_run_folder_opens_as_tables_and_arrays(tmp_path: Path) -> None:
    truth, recon = fake_run(tmp_path / "run")
    run = fedguard.open_run(tmp_path / "run")
    assert isinstance(run, fedguard.RunResults)
    assert list(run.rounds["round"]) == [0, 1] and run.rounds["defense.raw"].iloc[1] == 0.5
    assert "uploads" not in run.rounds.columns
    assert run.uploads.to_dict("records") == [
        {"round": 1, "client": 0, "raw": 1.0},
        {"round": 1, "client": 1, "raw": 0.0},
    ]
    assert list(run.attacks["attack"]) == ["ig", "idlg"] and run.attacks["attack_params.iterations"].iloc[0] == 5
    assert "per_image" not in run.attacks.columns
    assert list(run.image_scores["image"]) == [0, 1, 2] and list(run.image_scores["ssim"]) == [0.8, 0.9, 1.0]
    got_truth, got_recon = run.images("ig", round=1, client=1)
    assert got_truth.shape == got_recon.shape == (3, 1, 4, 4) and got_recon.dtype == np.float32
    assert np.array_equal(got_truth, truth.numpy()) and np.array_equal(got_recon, recon.numpy())
    with pytest.raises(
        KeyError,
        match=r"no scored reconstruction of attack 'idlg', round 1, client 0 .*"
        r"scored \(attack, round, client, invocation\): \[\('ig', 1, 1, 'run'\)\]",
    ):
        run.images("idlg", round=1, client=0)
    with pytest.raises(FileNotFoundError, match="holds no run \\(rounds.jsonl\\) and no sweep \\(runs.jsonl\\)"):
        fedguard.open_run(tmp_path)


def test_a_sweep_folder_opens_as_cells_runs_and_leakage(tmp_path: Path) -> None:
    leak = {"attack": "ig", "round": 1, "n_images": 3, "adaptive": False, "ssim_mean": 0.9, "ssim_ci95": [0.8, 1.0]}
    jsonl(
        tmp_path / "runs.jsonl",
        [
            {
                "setting": "s",
                "variant": "none",
                "seed": seed,
                "status": "ok",
                "accuracy": 0.5 + seed / 10,
                "folder": str(tmp_path / "s" / "none" / f"seed-{seed}"),
                "privacy": {"by_attack": [leak]},
            }
            for seed in (0, 1)
        ],
    )
    jsonl(
        tmp_path / "sweep.jsonl",
        [
            {
                "setting": "s",
                "variant": "none",
                "status": "ok",
                "accuracy": 0.55,
                "accuracy_ci95": [0.4, 0.7],
                "attacks": {"ig": {}},
                "privacy": {**leak, "per_round": [leak], "by_attack": [leak, {**leak, "round": 5}]},
            }
        ],
    )
    (tmp_path / "summary.md").write_text("| variant |\n")
    fake_run(tmp_path / "s" / "none" / "seed-1")
    sweep = fedguard.open_run(tmp_path)
    assert isinstance(sweep, fedguard.SweepResults) and sweep.summary == "| variant |\n"
    assert sweep.cells["privacy.ssim_mean"].iloc[0] == 0.9 and "attacks" not in sweep.cells.columns
    assert list(sweep.runs["seed"]) == [0, 1] and "privacy" not in sweep.runs.columns
    assert sweep.leakage[["variant", "attack", "round", "ssim_mean"]].to_dict("records") == [
        {"variant": "none", "attack": "ig", "round": r, "ssim_mean": 0.9} for r in (1, 5)
    ]
    assert list(sweep.run("s", "none", seed=1).rounds["round"]) == [0, 1]
    with pytest.raises(KeyError, match=r"no single run s/none \(give its seed\) .* runs: s/none seed 0, s/none seed 1"):
        sweep.run("s", "none")


@pytest.mark.slow
def test_a_run_started_from_python_keeps_the_arrays_it_scored(tmp_path: Path) -> None:
    lines: list[str] = []
    run = fedguard.run(
        QUICKSTART,
        out=tmp_path / "run",
        progress=lines.append,
        overrides=[
            "train.rounds=2",
            "partition.num-clients=3",
            "train.clients-per-round=3",
            "capture.clients=0",
            "attack.ig.iterations=30",
            "attack.ig.restarts=1",
            "sim.num-cpus=2",
            "track.tensorboard=true",
            "track.mlflow=true",
        ],
    )
    assert run.status == {"status": "completed", "rounds": 2} and any("round 2" in line for line in lines), lines[-5:]
    assert list(run.rounds["round"]) == [0, 1, 2] and run.report.is_file()
    [row] = run.attacks.to_dict("records")
    truth, recon = run.images("ig", round=1, client=0)
    assert truth.shape == recon.shape == (8, 1, 28, 28)
    scored = run.image_scores
    assert list(scored["psnr"]) == pytest.approx(
        [psnr(torch.from_numpy(r)[None], torch.from_numpy(t)[None]).item() for r, t in zip(recon, truth)], abs=1e-3
    )
    assert row["psnr"] == pytest.approx(scored["psnr"].mean(), abs=1e-3)
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.folder / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("round/accuracy")] == [0, 1, 2], "the run's rounds reached TensorBoard"
    assert [e.value for e in events.Scalars("attack/ig/ssim")] == pytest.approx([row["ssim"]])
    client = MlflowClient(f"sqlite:///{run.folder / 'mlflow.db'}")
    [tracked] = client.search_runs([client.get_experiment_by_name("fedguard").experiment_id])
    assert tracked.info.status == "FINISHED" and tracked.data.metrics["attack/ig/psnr"] == pytest.approx(row["psnr"])
    assert tracked.info.run_name == run.folder.name, "an MLflow run is named after its folder"
    with pytest.raises(FileExistsError, match="already holds a run"):
        fedguard.run(QUICKSTART, out=tmp_path / "run", progress=None)
