"""A run plan rebuilds the configuration it was made from, exactly, in another process and without validating it
again; a plan changed on its way is refused; a client rebuilding one loads no attack code."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedguard.commands.sweep import load_sweep
from fedguard.config import Config, ConfigError, load_config
from fedguard.run_plan import PLAN_KEY, PlanError, plan_keys, plan_text
from tests.helpers import config

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {
    "two attacks with their own parameters": ("attack.name=ig,dlg", "attack.ig.iterations=7", "capture.rounds=1"),
    "update-level dp": ("defense.name=dp", "defense.dp.noise-multiplier=0.3", "defense.dp.clip=2.5"),
    "a malicious server and the clients' detectors": (
        "attack.name=imprint",
        "threat.malicious=1:imprint",
        "manipulation.imprint.bins=8",
        "capture.rounds=1",
        "detect.name=structure,dsnr",
        "detect.action=report",
    ),
    "fedavg with local epochs": ("train.protocol=fedavg", "train.local-epochs=2", "server.strategy=fedmedian"),
    "a plugin defense": (
        "server.plugins=extensions.sign_upload",
        "defense.name=sign",
        "defense.sign.scale=0.5",
    ),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_plan_rebuilds_its_configuration_exactly(setting: str) -> None:
    built = config(*SETTINGS[setting])
    assert Config.from_plan(built.plan()) == built
    assert Config.from_run_config({PLAN_KEY: built.plan(), "train.rounds": 99}) == built  # the plan wins


@pytest.mark.parametrize("preset", ["quickstart", "attacks", "fishing"])
def test_every_run_preset_survives_its_plan(preset: str) -> None:
    built = load_config(ROOT / "experiments" / f"{preset}.toml", [])
    assert Config.from_plan(built.plan()) == built


def test_every_run_of_the_defenses_sweep_survives_its_plan(tmp_path: Path) -> None:
    """Every cell of the defenses preset (each defense, dp-sgd with its accountant, the malicious server with the
    clients' detectors, secure aggregation), at one seed."""
    runs = load_sweep(ROOT / "experiments" / "defenses.toml", out=tmp_path, seeds=[0]).runs
    assert len(runs) > 20
    for run in runs:
        assert Config.from_plan(run.config.plan()) == run.config, f"{run.setting}/{run.variant}"


def test_a_clients_plan_leaves_out_the_attacks_and_manipulations_and_nothing_else() -> None:
    built = config(*SETTINGS["a malicious server and the clients' detectors"])
    client_side = Config.from_plan(built.plan(), attack_side=False)
    assert client_side == dataclasses.replace(built, attacks=(), manipulations=())
    assert client_side.detectors == built.detectors and client_side.threat == built.threat


def test_without_a_plan_the_run_config_is_validated_as_flwr_run_passes_it() -> None:
    assert Config.from_run_config({PLAN_KEY: "", "train.rounds": 3}).train.rounds == 3
    with pytest.raises(ConfigError, match="train.rounds"):
        Config.from_run_config({PLAN_KEY: "", "train.rounds": -1})


def test_a_plan_changed_on_its_way_is_refused() -> None:
    text = config("train.rounds=3").plan()
    assert plan_keys(text)["train.rounds"] == 3
    changed = json.loads(text)
    changed["keys"]["train.rounds"] = 300
    with pytest.raises(PlanError, match="do not match their sha256 digest"):
        plan_keys(json.dumps(changed))
    for broken, fragment in [(text[: len(text) // 2], "is not a run plan"), ('{"keys": 1}', "no 'keys' table")]:
        with pytest.raises(PlanError, match=fragment):
            plan_keys(broken)
    with pytest.raises(ConfigError, match="do not match"):
        Config.from_plan(json.dumps(changed))


def test_a_plan_is_one_line_of_json_without_not_a_number() -> None:
    assert "\n" not in plan_text({"a.b": 1.5, "c.d": "x"})
    with pytest.raises(ValueError):
        plan_text({"a.b": float("nan")})


def test_a_plan_naming_a_plugin_this_process_cannot_import_is_refused() -> None:
    keys = plan_keys(config().plan())
    keys["server.plugins"] = "no_such_plugin_module"
    with pytest.raises(ConfigError, match="no_such_plugin_module"):
        Config.from_plan(plan_text(keys))


@pytest.mark.parametrize("module", ["clients.defended_client", "fedguard.runtime.client_app"])
def test_the_client_imports_no_attack_code(module: str) -> None:
    """The client's modules, and a client rebuilding a plan of a run with attacks, a malicious server and
    detectors, load no ``attackers`` module."""
    plan = config(*SETTINGS["a malicious server and the clients' detectors"]).plan()
    probe = (
        f"import sys, {module}; "
        "from fedguard.config import Config; "
        f"Config.from_plan(sys.argv[1], attack_side=False); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'attackers'))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe, plan], capture_output=True, text=True, check=True, cwd=ROOT, timeout=120
    )
    assert loaded.stdout.strip() == "[]", loaded.stdout
