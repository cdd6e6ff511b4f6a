"""Traits: what attacks, defenses and datasets declare without being built or loaded, the server's file check,
and the memoized configuration."""

from __future__ import annotations

import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import fedguard.config as config_module
from attackers import ATTACKS
from attackers.base import attack_traits, build_attack, check_attack_files, missing_attack_files
from attackers.generators import Decoder, TrainedGenerator, save_generator
from attackers.mjolnir import INNER_ATTACKS
from fedguard.config import Component, Config, ConfigError
from fedguard.data import load_dataset
from fedguard.data.local import DEBIAN_FASHION_MNIST
from fedguard.data.registry import SourceOptions, dataset_spec
from fedguard.defenses.dp_update import UpdateDPParams
from fedguard.registry import Registry

FILES = {"generator": "g.npz", "denoiser": "d.npz"}  # never opened: the loaders are replaced by stubs


def problems_of(flat: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        Config.from_flat(flat)
    return caught.value.problems


def with_files(name: str, **changes: Any) -> Any:
    """Default parameters of attack ``name`` with its file parameters set, and ``changes``."""
    params = ATTACKS.get(name).params
    fields = set(params.__dataclass_fields__)
    return params(**{**{k: v for k, v in FILES.items() if k in fields}, **changes})


CASES = (
    [(name, {}) for name in ATTACKS.names()]
    + [("ig", {"eot": 2})]
    + [
        (f"mjolnir+{inner}", changes)
        for inner in INNER_ATTACKS
        for changes in ({"noise_source": "given", "noise_std": 0.1}, {"noise_source": "estimate"})
    ]
    + [("mjolnir+ig", {"eot": 2})]
)


@pytest.mark.parametrize("name, changes", CASES)
def test_traits_match_the_built_attack(name: str, changes: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("attackers.generative.load_generator", lambda path: SimpleNamespace())
    monkeypatch.setattr("attackers.mjolnir.load_ddpm", lambda path: SimpleNamespace(conditional=False))
    params = with_files(name, **changes)
    traits = attack_traits(name, params)
    built = build_attack(name, params, ("dp", UpdateDPParams()))
    assert (traits.uploads, traits.needs, traits.manipulation) == (built.uploads, built.needs, built.manipulation)
    assert traits.needs_by_upload == getattr(built, "needs_by_upload", {})
    assert traits.simulates_defense == bool(getattr(params, "eot", 0))
    assert {f.param for f in traits.files} == {k for k in FILES if k in params.__dataclass_fields__}


@pytest.mark.parametrize(
    ("name", "changes", "adaptive"),
    [
        ("ig", {}, False),
        ("ig", {"skip": "fc.weight"}, True),
        ("ig", {"eot": 2}, True),
        ("idlg", {}, False),
        ("gradinversion", {}, False),
        ("ggl", {}, False),
        ("mjolnir+idlg", {}, True),
        ("mjolnir+idlg", {"noise_source": "estimate"}, False),
        ("mjolnir+ig", {"noise_source": "estimate", "skip": "fc.weight"}, True),
    ],
)
def test_an_attack_is_adaptive_when_its_parameters_use_the_defense(
    name: str, changes: dict[str, Any], adaptive: bool
) -> None:
    assert attack_traits(name, with_files(name, **changes)).adaptive is adaptive


def test_configuration_builds_no_attack_or_defense_and_loads_no_file(monkeypatch: pytest.MonkeyPatch) -> None:
    original = Registry.build

    def build(self: Registry, name: str, *args: Any, params: Any = None) -> Any:
        assert self.kind not in ("attack", "defense"), f"the configuration built {self.kind} {name!r}"
        return original(self, name, *args, params=params)

    monkeypatch.setattr(Registry, "build", build)
    config = Config.from_flat(
        {
            "attack.name": "ig, ggl, mjolnir+ig, mjolnir+ggl",
            "attack.ggl.generator": "absent/g.npz",
            "attack.mjolnir+ig.denoiser": "absent/d.npz",
            "attack.mjolnir+ggl.denoiser": "absent/d.npz",
            "attack.mjolnir+ggl.generator": "absent/g.npz",
            "attack.ig.eot": 2,
            "threat.defense": True,
            "defense.name": "dp",
            "name": uuid.uuid4().hex,
        }
    )
    assert config.attack_names() == ["ig", "ggl", "mjolnir+ig", "mjolnir+ggl"]
    assert Config.from_flat({"defense.name": "refiner", "defense.refiner.evalnet": "absent/e.npz"})


def test_unset_files_are_still_configuration_errors() -> None:
    [problem] = problems_of({"attack.name": "ggl"})
    assert problem.startswith("attack.ggl: attack 'ggl' needs a generator: set attack.ggl.generator")
    [problem] = problems_of({"attack.name": "mjolnir+ig", "threat.defense": True, "defense.name": "dp"})
    assert problem.startswith("attack.mjolnir+ig: Mjölnir needs a diffusion model")
    [problem] = problems_of({"defense.name": "refiner"})
    assert "defense.refiner: defense 'refiner' needs an evaluation network" in problem


def test_eot_against_a_defense_that_cannot_be_simulated() -> None:
    [problem] = problems_of(
        {"attack.name": "ig", "attack.ig.eot": 2, "threat.defense": True, "defense.name": "soteria"}
    )
    assert "EOT needs a defense that can be simulated; defense.name = 'soteria'" in problem
    assert "attack.ig.eot = 0" in problem


def test_the_model_check_needs_no_data() -> None:
    """cifar10 is not on this machine: its static spec is enough to refuse a BatchNorm model for dp-sgd."""
    [problem] = problems_of(
        {"defense.name": "dp-sgd", "data.name": "cifar10", "data.root": "/absent", "model.mlp.batch-norm": True}
    )
    assert "defense.dp-sgd with model.name = 'mlp'" in problem and "BatchNorm" in problem


def test_the_server_reports_each_missing_file_with_its_key(tmp_path: Path) -> None:
    present = save_generator(
        TrainedGenerator(Decoder(load_dataset("digits").spec, 4, 4), "digits", "test", (1.0,)), tmp_path / "present.npz"
    )
    ggl = Component("ggl", with_files("ggl", generator=str(tmp_path / "g.npz")))
    stacked = Component(
        "mjolnir+ggl", with_files("mjolnir+ggl", denoiser=str(tmp_path / "d.npz"), generator=str(present))
    )
    problems = missing_attack_files([ggl, stacked, Component("ig", with_files("ig"))])
    assert problems == [
        f"attack.ggl.generator = {str(tmp_path / 'g.npz')!r}: no generator at {tmp_path / 'g.npz'}; create it with "
        f"`fedguard train-generator --data <dataset> --out {tmp_path / 'g.npz'}`",
        f"attack.mjolnir+ggl.denoiser = {str(tmp_path / 'd.npz')!r}: no Mjölnir diffusion model at "
        f"{tmp_path / 'd.npz'}; create it with `fedguard train-mjolnir`",
    ]
    with pytest.raises(FileNotFoundError, match=r"attack\.ggl\.generator(.|\n)*attack\.mjolnir\+ggl\.denoiser"):
        check_attack_files([ggl, stacked])
    check_attack_files([Component("ggl", with_files("ggl", generator=str(present)))])


def test_identical_flat_configs_are_validated_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    original = config_module._build
    monkeypatch.setattr(config_module, "_build", lambda flat: calls.append(dict(flat)) or original(flat))
    flat = {"name": uuid.uuid4().hex, "train.rounds": 3, "threat.labels": True}
    first = Config.from_flat(flat)
    assert Config.from_flat(dict(reversed(flat.items()))) is first and len(calls) == 1
    assert Config.from_flat({**flat, "train.rounds": 4}) is not first and len(calls) == 2
    assert any("threat.labels = 1: expected bool" in p for p in problems_of({**flat, "threat.labels": 1}))
    assert problems_of({**flat, "data.name": ["mnist"]})  # unhashable: validated (and refused) without the cache


@pytest.mark.parametrize("name", ["digits", "mnist-5k", "lfw-faces", "photos", "fashion-mnist"])
def test_static_specs_equal_the_loaded_ones(name: str) -> None:
    if name == "fashion-mnist" and not (DEBIAN_FASHION_MNIST / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip("Debian package dataset-fashion-mnist not installed")
    options = SourceOptions(image_size=16) if name == "photos" else SourceOptions()
    assert dataset_spec(name, options) == load_dataset(name, options).spec
