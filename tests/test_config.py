"""Configuration: defaults, validation messages, presets, overrides, pyproject consistency."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from attackers.diffusion import DDPMTrainOptions, SurrogateOptions, save_ddpm
from attackers.diffusion.pipeline import train_mjolnir
from attackers.generators import TrainedGenerator, TrainOptions, save_generator, train_vae
from fedguard.commands.sweep import load_preset
from fedguard.config import Config, ConfigError, flatten, load_config, parse_override, schema, split_names
from fedguard.data.spec import DataSpec
from fedguard.defenses.evalnet import EvalNetOptions, default_evalnet_path, save_evalnet, train_evalnet
from fedguard.registry import field_help
from fedguard.run_plan import PLAN_KEY
from fedguard.selection import Selection
from fedguard.store.run_dir import CONFIG_FILE, prepare_run_dir, resolve_run_dir, unflatten
from tests.helpers import FASHION_MNIST

ROOT = Path(__file__).resolve().parents[1]


def problems_of(flat: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        Config.from_flat(flat)
    return caught.value.problems


def test_defaults_are_valid_and_frozen() -> None:
    config = Config.from_flat({})
    assert config == Config()
    with pytest.raises(AttributeError):
        config.train.rounds = 3  # type: ignore[misc]


def test_pyproject_lists_every_key_with_its_default() -> None:
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    declared = flatten(table)
    assert declared.pop(PLAN_KEY) == ""  # the run plan, which only `fedguard run` fills in
    assert declared == Config().to_flat()
    assert Config.from_flat(declared) == Config()
    assert Config.from_run_config(flatten(table)) == Config()


def test_every_preset_is_valid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Presets that need trained networks get small ones made here, where they look (users make theirs first)."""
    decoder, losses = train_vae(torch.rand(8, 1, 28, 28), DataSpec(1, 28, 28, 10), TrainOptions(epochs=1, width=8))
    generator = save_generator(TrainedGenerator(decoder, "mnist-5k", "test", tuple(losses)), tmp_path / "g.npz")
    for dataset in ("photos", "mnist-5k"):
        save_evalnet(
            train_evalnet(dataset, "test", EvalNetOptions(epochs=1, width=2, mixes=1)),
            tmp_path / default_evalnet_path(dataset),
        )
    surrogate = SurrogateOptions(epochs=1, gradients=4)
    digits = "fashion-mnist" if FASHION_MNIST else "mnist-5k"  # the same 1x28x28 shape: the checks see no difference
    for model, params, dataset in (
        ("lenet", None, "photos"),
        ("mlp", {"hidden": 64}, "digits"),
        ("lenet", None, digits),
    ):
        denoiser, _ = train_mjolnir(model, params, dataset, surrogate, "cpu", DDPMTrainOptions(epochs=1, batch_size=4))
        save_ddpm(denoiser, tmp_path / "mjolnir" / f"{dataset.replace('mnist-5k', 'fashion-mnist')}-{model}.npz")
    conditional, _ = train_mjolnir(
        "lenet", None, digits, surrogate, "cpu", DDPMTrainOptions(epochs=1, batch_size=4, noise_range=(0.01, 100.0))
    )
    save_ddpm(conditional, tmp_path / "mjolnir" / "fashion-mnist-lenet-conditional.npz")
    monkeypatch.chdir(tmp_path)
    presets = sorted((ROOT / "experiments").rglob("*.toml"))
    assert presets, "no presets found"
    for preset in presets:
        flat = flatten(tomllib.loads(preset.read_text()))
        if "ggl" in split_names(flat.get("attack.name", "")):
            load_config(preset, [f"attack.ggl.generator={generator}"])
        else:
            load_preset(preset)


def test_unknown_key_names_the_key_and_suggests() -> None:
    [problem] = problems_of({"train.round": 5})
    assert "'train.round'" in problem and "train.rounds" in problem


def test_wrong_type_names_key_value_and_type() -> None:
    [problem] = problems_of({"train.lr": "fast"})
    assert "train.lr" in problem and "'fast'" in problem and "float" in problem
    [problem] = problems_of({"train.rounds": True})
    assert "train.rounds" in problem and "int" in problem


def test_out_of_range_value() -> None:
    [problem] = problems_of({"data.test-fraction": 1.5})
    assert "data.test-fraction = 1.5" in problem and "< 1.0" in problem


def test_unknown_component_lists_choices() -> None:
    [problem] = problems_of({"model.name": "vgg"})
    assert "'vgg'" in problem and "lenet" in problem and "resnet18" in problem
    [problem] = problems_of({"data.name": "cifar"})
    assert "cifar10" in problem and "mnist-5k" in problem


def test_component_parameter_checked() -> None:
    [problem] = problems_of({"model.convnet.width": 0})
    assert "model.convnet" in problem and "width" in problem


def test_all_problems_reported_together() -> None:
    problems = problems_of({"train.rounds": 0, "bogus": 1, "partition.name": "random", "capture.rounds": "x"})
    assert len(problems) == 4


def test_clients_per_round_cannot_exceed_clients() -> None:
    [problem] = problems_of({"train.clients-per-round": 11, "partition.num-clients": 10})
    assert "train.clients-per-round = 11" in problem


def test_int_accepted_for_float() -> None:
    assert Config.from_flat({"train.lr": 1}).train.lr == 1.0


def test_override_parsing_uses_schema_types() -> None:
    assert parse_override("train.rounds=5") == ("train.rounds", 5)
    assert parse_override("data.download=true") == ("data.download", True)
    assert parse_override("train.lr=0.25") == ("train.lr", 0.25)
    assert parse_override("data.name=photos") == ("data.name", "photos")
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("train.rounds")
    with pytest.raises(ConfigError, match="expected int"):
        parse_override("train.rounds=many")


def test_preset_then_overrides(tmp_path: Path) -> None:
    preset = tmp_path / "p.toml"
    preset.write_text(
        'name = "p"\n[train]\nrounds = 7\nlr = 0.2\n[model]\nname = "convnet"\n[model.convnet]\nwidth = 8\n'
    )
    config = load_config(preset, ["train.rounds=9"])
    assert (config.run.name, config.train.rounds, config.train.lr) == ("p", 9, 0.2)
    assert config.model.name == "convnet" and config.model.params.width == 8


def test_missing_and_broken_presets(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("name = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)


def test_written_config_reproduces_the_run(tmp_path: Path) -> None:
    config = load_config(None, ["train.rounds=3", "model.name=mlp", "model.mlp.hidden=17", f"out-dir={tmp_path / 'r'}"])
    folder = prepare_run_dir(config)
    assert load_config(folder / CONFIG_FILE) == config


def test_default_run_dir_never_overwrites(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    surrogate = SurrogateOptions(epochs=1, gradients=4)
    denoiser, _ = train_mjolnir("lenet", None, "photos", surrogate, "cpu", DDPMTrainOptions(epochs=1, batch_size=4))
    save_ddpm(denoiser, tmp_path / "mjolnir" / "photos-lenet.npz")
    monkeypatch.chdir(tmp_path)
    config = load_config(None, ["name=x"])
    first = resolve_run_dir(config)
    assert first == tmp_path / "runs" / "x"
    first.mkdir(parents=True)
    (first / "rounds.jsonl").write_text("")
    assert resolve_run_dir(config) == tmp_path / "runs" / "x-2"
    explicit = load_config(None, [f"out-dir={first}"])
    with pytest.raises(FileExistsError, match="already holds a run"):
        resolve_run_dir(explicit)


def test_unflatten_inverts_flatten() -> None:
    flat = Config().to_flat()
    assert flatten(unflatten(flat)) == flat


def test_schema_has_help_for_every_section_key() -> None:
    for key, (_, _, help_text) in schema().items():
        assert help_text, key


def test_every_component_parameter_has_a_help_line_of_its_own() -> None:
    """`fedguard config --keys` explains each parameter by itself, not by its component's summary."""
    by_component: dict[str, dict[str, str]] = {}
    for key, (_, _, help_text) in schema().items():
        if key.count(".") >= 2:  # kind.component.parameter
            component, parameter = key.rsplit(".", 1)
            by_component.setdefault(component, {})[parameter] = help_text
    assert {"defense.dp", "attack.dlg", "attack.mjolnir+ig", "manipulation.imprint", "model.mlp"} <= by_component.keys()
    for component, helps in by_component.items():
        shared = {text for text in helps.values() if list(helps.values()).count(text) > 1}
        assert not shared, f"{component}: parameters share {shared}"
        assert all(text and "\n" not in text and "``" not in text for text in helps.values()), (component, helps)
    keys = schema()
    assert "epsilon" in keys["defense.dp.epsilon"][2] and "delta" in keys["defense.dp.epsilon"][2]
    assert keys["attack.mjolnir+dlg.history"][2] == keys["attack.dlg.history"][2] == "L-BFGS history length"


@dataclasses.dataclass(frozen=True)
class _Documented:
    """An example. ``first_one``: counts things, see ``second``;
    across lines; ``second``: given by metadata in the end; ``third``: last."""

    first_one: int = 1
    second: int = dataclasses.field(default=2, metadata={"help": "from the metadata"})
    third: float = 0.0
    fourth: str = ""


def test_a_parameters_help_comes_from_its_metadata_else_its_own_part_of_the_docstring() -> None:
    assert field_help(_Documented, "first_one") == "counts things, see second; across lines"
    assert field_help(_Documented, "second") == "from the metadata"
    assert field_help(_Documented, "third") == "last"
    assert field_help(_Documented, "fourth") == "An example. first-one: counts things, see second"


@pytest.mark.parametrize(
    ("spec", "inside", "outside"),
    [("all", [0, 5, 999], []), ("none", [], [0, 1]), ("1,3-5", [1, 3, 4, 5], [0, 2, 6]), ("2", [2], [1, 3])],
)
def test_selection(spec: str, inside: list[int], outside: list[int]) -> None:
    selection = Selection.parse(spec)
    assert all(i in selection for i in inside)
    assert not any(o in selection for o in outside)


@pytest.mark.parametrize("spec", ["a", "3-1", "1,,x", "-2"])
def test_bad_selection(spec: str) -> None:
    with pytest.raises(ValueError, match="capture.rounds"):
        Selection.parse(spec, "capture.rounds")


def test_attack_must_fit_the_protocol() -> None:
    [problem] = problems_of({"attack.name": "dlg", "train.protocol": "fedavg"})
    assert "attack 'dlg'" in problem and "gradient" in problem and "fedavg" in problem
    assert Config.from_flat({"attack.name": "ig", "train.protocol": "fedavg"}).attack_names() == ["ig"]


def test_weight_uploads_need_the_declared_hyperparameters() -> None:
    [problem] = problems_of({"attack.name": "ig", "train.protocol": "fedavg", "threat.hyperparameters": False})
    assert "hyperparameters" in problem
    assert Config.from_flat({"attack.name": "ig", "threat.hyperparameters": False}).attack_names() == ["ig"]


def test_attack_needs_must_be_granted() -> None:
    [problem] = problems_of({"attack.name": "ig", "attack.ig.eot": 2})
    assert "defense (the clients' defense" in problem and "threat." in problem
    config = Config.from_flat({"attack.name": "ig", "attack.ig.eot": 2, "threat.defense": True})
    assert config.attack_names() == ["ig"]


def test_unknown_attack_lists_none_and_registered() -> None:
    [problem] = problems_of({"attack.name": "dlg2"})
    assert "none" in problem and "ig" in problem


def test_several_attacks_with_their_own_parameters() -> None:
    config = Config.from_flat({"attack.name": "ig, idlg", "attack.idlg.iterations": 7, "attack.ig.restarts": 3})
    assert config.attack_names() == ["ig", "idlg"]
    assert config.attacks[0].params.restarts == 3 and config.attacks[1].params.iterations == 7
    assert config.to_flat()["attack.name"] == "ig,idlg"
    assert Config.from_flat(config.to_flat()) == config
    assert Config.from_flat({"attack.name": "none"}).attacks == ()


@pytest.mark.parametrize(
    "names, fragment", [("ig,ig", "twice"), ("ig,none", "'none' is not one of"), ("ig,dl", "'dl' is not one of")]
)
def test_bad_attack_lists(names: str, fragment: str) -> None:
    [problem] = problems_of({"attack.name": names})
    assert fragment in problem and repr(names) in problem


def test_malicious_schedule_is_parsed_and_checked() -> None:
    config = Config.from_flat(
        {
            "threat.malicious": "2:trap-weights, 3:imprint",
            "capture.rounds": "1-3",
            "train.rounds": 3,
            "manipulation.imprint.bins": 32,
        }
    )
    assert config.threat.schedule() == {2: "trap-weights", 3: "imprint"}
    assert config.threat.model() == "malicious" and Config.from_flat({}).threat.model() == "honest"
    assert [m.name for m in config.manipulations] == ["imprint", "trap-weights"]
    assert config.manipulation("imprint").params.bins == 32
    assert Config.from_flat(config.to_flat()) == config
    for text, fragment in [
        ("2", "round:manipulation"),
        ("x:imprint", "round:manipulation"),
        ("2:imprnt", "choose one of"),
        ("2:imprint,2:trap-weights", "twice"),
        ("1-3:fishing, 3:imprint", "round 3 is manipulated twice"),
        ("3-1:fishing", "run backwards"),
        ("1-x:fishing", "round:manipulation"),
    ]:
        [problem] = problems_of({"threat.malicious": text, "capture.rounds": "all"})
        assert fragment in problem, problem
    [problem] = problems_of({"threat.malicious": "2:imprint", "capture.rounds": "1"})
    assert "round 2" in problem and "capture.rounds" in problem
    schedule = {"threat.malicious": "1:fishing, 2-4:feature-fishing", "capture.rounds": "all"}
    spans = Config.from_flat({**schedule, "partition.max-per-client": 32})
    assert spans.threat.schedule() == {1: "fishing", 2: "feature-fishing", 3: "feature-fishing", 4: "feature-fishing"}


def test_attacks_are_matched_to_the_rounds_they_can_attack() -> None:
    [problem] = problems_of({"attack.name": "imprint", "capture.rounds": "1"})
    assert "manipulated with 'imprint'" in problem and "threat.malicious = '1:imprint'" in problem
    [problem] = problems_of({"attack.name": "ig", "threat.malicious": "1:imprint", "capture.rounds": "1"})
    assert "does not manipulate" in problem
    config = Config.from_flat({"attack.name": "ig,imprint", "threat.malicious": "2:imprint", "capture.rounds": "1,2"})
    assert config.attack_names() == ["ig", "imprint"]


def test_the_schema_imports_no_registry_of_defenses_attacks_strategies_or_models() -> None:
    """``fedguard.schema`` is the configuration's pure part: importing it loads none of the component packages."""
    probe = (
        "import sys, fedguard.schema; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('attackers', 'strategies', 'clients') "
        "or m.startswith(('fedguard.defenses', 'fedguard.models', 'fedguard.config'))))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert loaded.stdout.strip() == "[]", loaded.stdout
