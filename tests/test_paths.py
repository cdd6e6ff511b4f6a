"""Paths in a configuration are resolved once, against the folder the command runs in; a client that cannot train
in any round stops the run with its reason; a sweep row of a failed run says so and carries no figure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Error, Message
from flwr.serverapp.strategy import FedAvg

from fedguard.commands.sweep import SweepRun, failed_row, load_sweep, summary_table
from fedguard.config import Config, ConfigError, load_config, path_values, relative_path_problems
from fedguard.data import load_dataset
from fedguard.models import build_model
from fedguard.runtime.client_app import make_client_app
from fedguard.training import get_arrays
from fedguard.wire.records import array_record, cannot_train
from strategies import AllClientsFailed, RoundGuard
from tests.helpers import Nodes, config, reply
from tests.local_grid import LocalGrid
from tests.test_strategies import RULES

ROOT = Path(__file__).resolve().parents[1]


def test_every_path_key_is_made_absolute_against_the_folder_the_command_runs_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        None,
        [
            "defense.name=refiner",
            "defense.refiner.evalnet=evalnets/d.npz",
            "data.root=data",
            "out-dir=out",
            "attack.name=ggl, ig",
            "attack.ggl.generator=generators/g.npz",
        ],
    )
    assert path_values(cfg) == {
        "out-dir": str(tmp_path / "out"),
        "data.root": str(tmp_path / "data"),
        "defense.refiner.evalnet": str(tmp_path / "evalnets" / "d.npz"),
        "attack.ggl.generator": str(tmp_path / "generators" / "g.npz"),
    }
    assert cfg.defense.params.evalnet == str(tmp_path / "evalnets" / "d.npz")
    flat = cfg.to_flat()  # what config.toml and the run config hold
    assert flat["defense.refiner.evalnet"] == str(tmp_path / "evalnets" / "d.npz")
    assert flat["attack.ggl.generator"] == str(tmp_path / "generators" / "g.npz")
    assert relative_path_problems(cfg) == []


def test_paths_in_a_preset_mean_what_they_mean_where_the_command_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "experiments" / "attacks.toml")
    assert cfg.attacks[[a.name for a in cfg.attacks].index("ggl")].params.generator == str(
        tmp_path / "generators" / "mnist-5k.npz"
    )
    other = tmp_path / "elsewhere"
    other.mkdir()
    assert load_config(None, ["data.root=~/sets", "out-dir=/abs/run"], base=other).data.root == str(
        Path.home() / "sets"
    )
    assert load_config(None, ["out-dir=/abs/run"], base=other).run.out_dir == "/abs/run"
    assert load_config(None, ["out-dir=run"], base=other).run.out_dir == str(other / "run")


def test_a_mjolnir_denoiser_path_is_resolved_with_its_inner_attacks_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        None,
        [
            "defense.name=dp",
            "threat.defense=true",
            "attack.name=mjolnir+ig",
            "attack.mjolnir+ig.denoiser=mjolnir/d.npz",
            "attack.mjolnir+ig.iterations=7",
        ],
    )
    params = cfg.attacks[0].params
    assert params.denoiser == str(tmp_path / "mjolnir" / "d.npz") and params.iterations == 7


def test_flwr_run_refuses_a_relative_file_path_naming_the_key() -> None:
    cfg = Config.from_flat(
        {"defense.name": "refiner", "defense.refiner.evalnet": "evalnets/d.npz", "out-dir": "runs/x"}
    )
    problems = relative_path_problems(cfg)
    assert len(problems) == 1, "out-dir keeps its meaning under flwr run (under the runs folder)"
    assert "defense.refiner.evalnet = 'evalnets/d.npz' is a relative path" in problems[0]
    assert "absolute path" in problems[0] and "fedguard run" in problems[0]


def test_a_sweep_resolves_paths_applies_overrides_last_and_keeps_only_the_runs_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "experiments").symlink_to(ROOT / "experiments")
    sweep = load_sweep(
        "experiments/defenses.toml", None, ["train.rounds=3", "capture.rounds=1"], ["refiner", "realistic/none"]
    )
    assert sweep.folder == tmp_path / "runs" / "defenses"
    assert sorted({(r.setting, r.variant) for r in sweep.runs}) == [("realistic", "none"), ("trained", "refiner")], (
        "the realistic setting runs no Refiner (a FedSGD defense)"
    )
    assert [r.seed for r in sweep.runs] == [0, 1, 2, 0, 1, 2]
    assert all(r.config.train.rounds == 3 for r in sweep.runs), "an override comes after the setting's keys"
    evalnets = {r.config.defense.params.evalnet for r in sweep.runs if r.variant == "refiner"}
    assert evalnets == {str(tmp_path / "evalnets" / "mnist-5k.npz")}
    with pytest.raises(ConfigError, match="--only 'trained/nothing': .* has no such run; choose a variant"):
        load_sweep("experiments/defenses.toml", None, [], ["trained/nothing"])
    with pytest.raises(ConfigError, match="--only 'realistic/refiner': .* has no such run"):
        load_sweep("experiments/defenses.toml", None, [], ["realistic/refiner"])


def test_a_client_that_cannot_load_its_file_stops_the_run_in_round_1_with_the_reason(tmp_path: Path) -> None:
    missing = tmp_path / "missing.npz"
    cfg = config("defense.name=refiner", f"defense.refiner.evalnet={missing}", "train.clients-per-round=4")
    grid = LocalGrid(make_client_app(cfg), 4)
    guard = RoundGuard(FedAvg(min_train_nodes=4, fraction_train=1.0), lambda *a: None, RULES)
    model = build_model(cfg.model.name, load_dataset(cfg.data.name).spec, cfg.model.params)
    names, arrays = list(model.state_dict()), get_arrays(model)
    sent = list(guard.configure_train(1, array_record(names, arrays), ConfigRecord(), grid))
    replies = list(grid.send_and_receive(sent))
    assert all(m.has_error() and cannot_train(m.error.reason) for m in replies)
    with pytest.raises(
        AllClientsFailed,
        match=rf"round 1: client \d .* cannot train in any round: "
        rf"MissingTrainedFile: .*no evaluation network at {missing}",
    ):
        guard.aggregate_train(1, replies)


def test_one_client_that_cannot_train_stops_the_run_though_the_others_uploaded() -> None:
    guard = RoundGuard(FedAvg(min_train_nodes=2), lambda *a: None, RULES)
    sent = sorted(
        guard.configure_train(1, array_record(["w"], [np.zeros(2, np.int64)]), ConfigRecord(), Nodes(2)),
        key=lambda m: m.metadata.dst_node_id,
    )
    good = reply(sent[0], [np.ones(2, np.int64)], 8, {"client": 0})
    sent[1].metadata.__dict__["_message_id"] = "m"
    bad = Message(
        Error(code=2, reason="cannot train in any round: ConfigError: invalid configuration"), reply_to=sent[1]
    )
    bad.metadata.__dict__["_src_node_id"] = sent[1].metadata.dst_node_id
    reason = r"client 1 \(node 101\) cannot train in any round: ConfigError: .* \(1 of 2 clients\)"
    with pytest.raises(AllClientsFailed, match=reason):
        guard.aggregate_train(1, [good, bad])


def test_a_failed_run_is_a_failed_row_with_its_reason_and_no_figure() -> None:
    cfg = load_config(None, [])
    run = SweepRun("utility", "refiner", cfg, Path("/runs/s/utility/refiner"))
    row = failed_row(run, "AllClientsFailed: round 1: no evaluation network", Path("/runs/s/utility/refiner.log"))
    assert row["status"] == "failed" and row["accuracy"] is None and "psnr" not in row
    ok = {
        "setting": "utility",
        "variant": "none",
        "status": "ok",
        "rounds": 5,
        "accuracy": 0.9,
        "seconds_per_round": 1.0,
    }
    table = summary_table([ok, row], "none")
    lines = table.splitlines()
    assert lines[0] == "| variant | utility: accuracy | % of baseline | s/round |"
    assert lines[3] == "| `refiner` | **failed** | - | - |"
