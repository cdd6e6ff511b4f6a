"""Trained files are checked on load: every corrupt file raises ``TrainedFileError`` naming it, what is wrong and
the command that makes a good one, and the server and ``fedguard attack`` refuse one before any round or attack."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from attackers.base import check_attack_files
from attackers.diffusion import (
    Checkpoint,
    DDPMTrainOptions,
    GradientSet,
    PackingSpec,
    Schedule,
    SurrogateOptions,
    TrainedDDPM,
    UNet,
    UNetConfig,
    load_checkpoint,
    load_ddpm,
    load_gradient_set,
    save_checkpoint,
    save_ddpm,
    save_gradient_set,
    train_ddpm,
)
from attackers.generative import GenerativeParams
from attackers.generators import Decoder, TrainedGenerator, load_generator, save_generator
from fedguard.commands.cli import main
from fedguard.config import Component, load_config
from fedguard.data.spec import DataSpec
from fedguard.defenses import build_defense
from fedguard.defenses.base import check_defense_files
from fedguard.defenses.evalnet import EvalNet, TrainedEvalNet, load_evalnet, save_evalnet
from fedguard.defenses.refiner import RefinerParams
from fedguard.registry import MissingTrainedFile, TrainedFileError
from fedguard.runtime.server_app import run_server
from fedguard.store.run_dir import OBSERVATIONS_DIR

SPEC = DataSpec(1, 8, 8, 10)
TINY = UNetConfig(base_channels=4, channel_mults=(1, 2), groups=2)
SCHEDULE = Schedule(steps=10)
TRAIN = DDPMTrainOptions(epochs=1, batch_size=4, schedule=SCHEDULE)


# --- small good files of every kind ----------------------------------------------------------------------------


def write_generator(path: Path) -> Path:
    return save_generator(TrainedGenerator(Decoder(SPEC, 4, 4), "digits", "test", (1.0,)), path)


def write_evalnet(path: Path) -> Path:
    return save_evalnet(TrainedEvalNet(EvalNet(SPEC, 2), "digits", "test", (0.1,)), path)


def write_ddpm(path: Path, conditional: bool = False, normalization: dict | None = None) -> Path:
    model = UNet(TINY, 8, conditional)
    noise_range = (0.5, 2.0) if conditional else None
    return save_ddpm(TrainedDDPM(model, SCHEDULE, normalization or {}, (1.0,), noise_range), path)


def write_checkpoint(path: Path) -> Path:
    states = []
    grids = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    train_ddpm(grids, TINY, TRAIN, checkpoint=states.append)
    return save_checkpoint(Checkpoint(states[-1], TINY, 8, TRAIN, {"model": "mlp"}, "0" * 64), path)


def write_gradient_set(path: Path) -> Path:
    options = SurrogateOptions(batch_size=2)
    gradients = GradientSet(
        torch.zeros(3, 1, 4, 4),
        PackingSpec(((3, 4),), 4, 1.0),
        "mlp",
        {},
        "digits",
        "test",
        SPEC,
        options,
        torch.zeros(3, dtype=torch.int64),
        torch.zeros(3, 2, dtype=torch.int64),
        torch.ones(3, dtype=torch.float64),
    )
    return save_gradient_set(gradients, path)


GOOD: dict[str, Callable[[Path], Path]] = {
    "generator": write_generator,
    "evalnet": write_evalnet,
    "ddpm": write_ddpm,
    "checkpoint": write_checkpoint,
    "gradients": write_gradient_set,
}
LOAD: dict[str, Callable[[Path], Any]] = {
    "generator": load_generator,
    "evalnet": load_evalnet,
    "ddpm": load_ddpm,
    "checkpoint": load_checkpoint,
    "gradients": load_gradient_set,
}
MJOLNIR_COMMAND = "fedguard train-mjolnir <preset> --out"
COMMAND = {
    "generator": "fedguard train-generator --data <dataset> --out",
    "evalnet": "fedguard train-evalnet --data <dataset> --out",
    "ddpm": MJOLNIR_COMMAND,
    "checkpoint": MJOLNIR_COMMAND,
    "gradients": MJOLNIR_COMMAND,
}
"""The start of the command each kind's errors give."""


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One good file of each kind (the checkpoint after one epoch on four 8 x 8 grids)."""
    folder = tmp_path_factory.mktemp("good")
    return {kind: write(folder / f"{kind}.npz") for kind, write in GOOD.items()}


# --- corruptions: each makes a bad file at ``path`` from a good one --------------------------------------------


def arrays_of(path: Path) -> dict[str, np.ndarray]:
    """Every entry of the good file at ``path``, by name."""
    with np.load(path, allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def rewritten(
    good: Path,
    path: Path,
    changes: dict | None = None,
    drop: tuple[str, ...] = (),
    arrays: dict[str, np.ndarray] | None = None,
) -> Path:
    """``good``'s entries with the meta fields ``changes`` changed, ``drop`` left out and ``arrays`` set, written
    to ``path``."""
    entries = {**arrays_of(good), **(arrays or {})}
    if changes is not None:
        entries["meta"] = np.array(json.dumps({**json.loads(str(entries["meta"])), **changes}))
    for name in drop:
        del entries[name]
    np.savez(path, **entries)
    return path


def first_weight(good: Path) -> tuple[str, np.ndarray]:
    """The name and array of the first weight matrix (or convolution kernel) in ``good``."""
    return next((name, array) for name, array in arrays_of(good).items() if array.ndim > 1)


def missing(good: Path, path: Path) -> Path:
    return path


def directory(good: Path, path: Path) -> Path:
    path.mkdir()
    return path


def empty(good: Path, path: Path) -> Path:
    path.write_bytes(b"")
    return path


def truncated(good: Path, path: Path) -> Path:
    path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    return path


def flipped_bytes(good: Path, path: Path) -> Path:
    """A byte inverted inside the first stored entry: the zip's CRC no longer matches."""
    data = bytearray(good.read_bytes())
    data[200] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def random_bytes(good: Path, path: Path) -> Path:
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    return path


def plain_zip(good: Path, path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("readme.txt", "not an array")
    return path


def one_array(good: Path, path: Path) -> Path:
    with open(path, "wb") as handle:
        np.save(handle, np.zeros(3))
    return path


def no_meta(good: Path, path: Path) -> Path:
    return rewritten(good, path, drop=("meta",))


def meta_not_json(good: Path, path: Path) -> Path:
    return rewritten(good, path, arrays={"meta": np.array("{format: 1")})


def meta_not_text(good: Path, path: Path) -> Path:
    return rewritten(good, path, arrays={"meta": np.arange(3)})


def meta_with_nan(good: Path, path: Path) -> Path:
    return rewritten(good, path, {"losses": [float("nan")]})


def other_format(good: Path, path: Path) -> Path:
    return rewritten(good, path, {"format": "fedguard-generator/0"})


def meta_without_spec(good: Path, path: Path) -> Path:
    entries = arrays_of(good)
    meta = json.loads(str(entries.pop("meta")))
    del meta["spec"]
    return rewritten(good, path, arrays={"meta": np.array(json.dumps(meta))})


def invalid_width(good: Path, path: Path) -> Path:
    return rewritten(good, path, {"width": 0})


def other_latent_dim(good: Path, path: Path) -> Path:
    return rewritten(good, path, {"latent_dim": 5})


def missing_weight(good: Path, path: Path) -> Path:
    return rewritten(good, path, drop=(first_weight(good)[0],))


def extra_weight(good: Path, path: Path) -> Path:
    return rewritten(good, path, arrays={"net/extra.weight": np.zeros(3, np.float32)})


def wrong_shape(good: Path, path: Path) -> Path:
    name, array = first_weight(good)
    return rewritten(good, path, arrays={name: np.zeros((array.shape[0] + 1, *array.shape[1:]), np.float32)})


def string_weights(good: Path, path: Path) -> Path:
    name, array = first_weight(good)
    return rewritten(good, path, arrays={name: np.full(array.shape, "w")})


def object_weights(good: Path, path: Path) -> Path:
    name, array = first_weight(good)
    return rewritten(good, path, arrays={name: np.full(array.shape, None, dtype=object)})


def nan_weights(good: Path, path: Path) -> Path:
    name, array = first_weight(good)
    array = array.copy()
    array.flat[0] = np.nan
    return rewritten(good, path, arrays={name: array})


def inf_weights(good: Path, path: Path) -> Path:
    name, array = first_weight(good)
    return rewritten(good, path, arrays={name: np.full_like(array, np.inf)})


def nan_adam_moment(good: Path, path: Path) -> Path:
    array = arrays_of(good)["adam/0/exp_avg"].copy()
    array.flat[0] = np.nan
    return rewritten(good, path, arrays={"adam/0/exp_avg": array})


def float_rng(good: Path, path: Path) -> Path:
    return rewritten(good, path, arrays={"rng": np.zeros(5056, np.float32)})


def no_rng(good: Path, path: Path) -> Path:
    return rewritten(good, path, drop=("rng",))


def inf_gradient(good: Path, path: Path) -> Path:
    images = arrays_of(good)["images"].copy()
    images[0, 0, 0, 0] = np.inf
    return rewritten(good, path, arrays={"images": images})


def fewer_gradients(good: Path, path: Path) -> Path:
    return rewritten(good, path, {"count": 4})


def generator_as_other_kind(good: Path, path: Path) -> Path:
    return write_generator(path)


def packing_for_another_side(good: Path, path: Path) -> Path:
    return write_ddpm(path, normalization={"packing": {"shapes": [[200]], "side": 16, "scale": 1.0}})


# (file kind, corruption, what the message says)
CASES = [
    ("generator", missing, "no generator at"),
    ("evalnet", directory, "is not an evaluation-network file: it is a directory"),
    ("ddpm", empty, "is not a Mjölnir diffusion model file: it is empty"),
    ("generator", truncated, "is not a generator file: it is a damaged zip archive (BadZipFile"),
    ("checkpoint", truncated, "is not a Mjölnir training checkpoint: it is a damaged zip archive"),
    ("gradients", truncated, "is not a Mjölnir gradient set: it is a damaged zip archive"),
    ("evalnet", flipped_bytes, "cannot be read (BadZipFile: Bad CRC-32"),
    ("evalnet", random_bytes, "is not an evaluation-network file: it is not an .npz archive (a zip of .npy arrays)"),
    ("generator", plain_zip, "is not a generator file: it lacks meta"),
    ("ddpm", one_array, "it holds one array, not an .npz archive"),
    ("evalnet", no_meta, "is not an evaluation-network file: it lacks meta"),
    ("generator", meta_not_json, "its meta is not valid JSON"),
    ("ddpm", meta_not_text, "its meta is an array of int64 and shape (3,), not a JSON string"),
    ("ddpm", meta_with_nan, "its meta holds the non-finite number NaN"),
    ("evalnet", other_format, "format 'fedguard-generator/0', expected 'fedguard-evalnet/1'"),
    ("ddpm", generator_as_other_kind, "format 'fedguard-generator/1', expected 'fedguard-mjolnir-ddpm/1'"),
    ("generator", meta_without_spec, "its meta lacks 'spec'"),
    ("evalnet", invalid_width, "its meta is invalid (ValueError: width must be >= 1, got 0)"),
    (
        "generator",
        other_latent_dim,
        "decoder arrays in the file do not match its meta: key 'decoder/net.0.weight' "
        "has shape (32, 4), expected (32, 5)",
    ),
    ("generator", missing_weight, "decoder arrays in the file do not match its meta: missing key 'decoder/net.0"),
    ("evalnet", extra_weight, "network arrays in the file do not match its meta: unexpected key 'net/extra.weight'"),
    ("ddpm", wrong_shape, "UNet arrays in the file do not match its meta: key 'unet/"),
    ("evalnet", string_weights, "has dtype <U1, expected float32"),
    ("generator", object_weights, "cannot be read (ValueError: Object arrays cannot be loaded when allow_pickle=False"),
    ("evalnet", nan_weights, "non-finite values in key 'net/features.0.weight' (1 NaN, 0 infinite of 18)"),
    ("ddpm", inf_weights, "non-finite values in key 'unet/"),
    ("checkpoint", nan_adam_moment, "non-finite values in key 'adam/0/exp_avg' (1 NaN"),
    ("checkpoint", float_rng, "key 'rng' has dtype float32, expected uint8"),
    ("checkpoint", no_rng, "is not a Mjölnir training checkpoint: it lacks rng"),
    ("gradients", inf_gradient, "non-finite values in key 'images' (0 NaN, 1 infinite of 48)"),
    ("gradients", fewer_gradients, "key 'images' has shape (3, 1, 4, 4), expected (4, 1, 4, 4)"),
    ("ddpm", packing_for_another_side, "its gradient packing makes grids of side 16, its UNet takes side 8"),
]


@pytest.mark.parametrize("kind, corrupt, says", CASES, ids=[f"{k}-{c.__name__}" for k, c, _ in CASES])
def test_a_corrupt_file_is_refused_with_its_name_the_problem_and_the_command(
    kind: str, corrupt: Callable[[Path, Path], Path], says: str, good: dict[str, Path], tmp_path: Path
) -> None:
    path = corrupt(good[kind], tmp_path / f"bad-{kind}.npz")
    with pytest.raises(TrainedFileError) as caught:
        LOAD[kind](path)
    message = str(caught.value)
    assert str(path) in message and says in message, message
    assert f"{COMMAND[kind]} " in message, message


def test_a_missing_file_is_also_a_file_not_found_error(tmp_path: Path) -> None:
    with pytest.raises(MissingTrainedFile) as caught:
        load_evalnet(tmp_path / "none.npz")
    assert isinstance(caught.value, FileNotFoundError) and isinstance(caught.value, ValueError)


def test_every_good_file_loads(good: dict[str, Path]) -> None:
    for kind, path in good.items():
        LOAD[kind](path)


def test_a_denoiser_of_the_other_kind_is_refused(tmp_path: Path) -> None:
    path = write_ddpm(tmp_path / "conditional.npz", conditional=True)
    with pytest.raises(TrainedFileError) as caught:
        load_ddpm(path, conditional=False)
    assert str(caught.value) == (
        f"{path}: its Mjölnir denoiser is conditional, expected unconditional; train one with `fedguard train-mjolnir`"
    )


def test_an_evaluation_network_for_other_images_is_refused(good: dict[str, Path]) -> None:
    path = good["evalnet"]
    with pytest.raises(TrainedFileError) as caught:
        load_evalnet(path).check_shape((3, 32, 32), path)
    assert f"the evaluation network {path} was trained on images of shape (1, 8, 8)" in str(caught.value)
    assert "`fedguard train-evalnet --data <dataset>`" in str(caught.value)


class Marker:
    """An object whose unpickling creates the file ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.path,))


def test_files_are_never_unpickled(good: dict[str, Path], tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    pickled = {first_weight(good["generator"])[0]: np.array([Marker(marker)], dtype=object)}
    path = rewritten(good["generator"], tmp_path / "pickled.npz", arrays=pickled)
    with pytest.raises(TrainedFileError, match="Object arrays cannot be loaded"):
        load_generator(path)
    with pytest.raises(TrainedFileError, match="Object arrays cannot be loaded"):
        check_attack_files([Component("ggl", GenerativeParams(generator=str(path)))])
    assert not marker.exists()


# --- checked before round 1 and before the first attack ---------------------------------------------------------


def test_the_attack_files_check_refuses_a_corrupt_generator_and_denoiser(good: dict[str, Path], tmp_path: Path) -> None:
    generator = nan_weights(good["generator"], tmp_path / "nan-generator.npz")
    denoiser = truncated(good["ddpm"], tmp_path / "short-denoiser.npz")
    config = load_config(
        None,
        [
            "attack.name=ggl,mjolnir+ig",
            f"attack.ggl.generator={generator}",
            f"attack.mjolnir+ig.denoiser={denoiser}",
            "defense.name=dp",
            "threat.defense=true",
        ],
    )
    with pytest.raises(TrainedFileError) as caught:
        check_attack_files(config.attacks)
    assert not isinstance(caught.value, FileNotFoundError)
    message = str(caught.value)
    assert f"attack.ggl.generator = {str(generator)!r}: {generator}: non-finite values in key" in message
    assert f"attack.mjolnir+ig.denoiser = {str(denoiser)!r}: {denoiser} is not a Mjölnir diffusion model" in message
    check_attack_files(load_config(None, ["attack.name=ggl", f"attack.ggl.generator={good['generator']}"]).attacks)


def test_a_nan_evaluation_network_is_refused_by_the_defense_and_the_server_check(
    good: dict[str, Path], tmp_path: Path
) -> None:
    evalnet = nan_weights(good["evalnet"], tmp_path / "nan-evalnet.npz")
    problem = f"{evalnet}: non-finite values in key 'net/features.0.weight' (1 NaN, 0 infinite of 18)"
    with pytest.raises(TrainedFileError) as built:
        build_defense("refiner", RefinerParams(evalnet=str(evalnet)))
    assert str(built.value).startswith(f"defense 'refiner': {problem}")
    with pytest.raises(TrainedFileError) as checked:
        check_defense_files("refiner", RefinerParams(evalnet=str(evalnet)))
    assert f"defense.refiner.evalnet = {str(evalnet)!r}: defense 'refiner': {problem}" in str(checked.value)
    check_defense_files("refiner", RefinerParams(evalnet=str(good["evalnet"])))
    check_defense_files("refiner", RefinerParams(evalnet=str(tmp_path / "on-the-clients.npz")))  # theirs to check


def test_an_evaluation_network_for_other_images_is_refused_before_a_simulation_starts(
    good: dict[str, Path],
) -> None:
    """Before, the check passed and every client failed at its first Refiner step."""
    params = RefinerParams(evalnet=str(good["evalnet"]))
    other = DataSpec(3, 32, 32, 10)
    with pytest.raises(TrainedFileError) as caught:
        check_defense_files("refiner", params, clients_here=True, spec=other)
    assert f"defense.refiner.evalnet = {str(good['evalnet'])!r}: the evaluation network" in str(caught.value)
    assert f"trained on images of shape {SPEC.shape} (digits), but these images have shape (3, 32, 32)" in str(
        caught.value
    )
    check_defense_files("refiner", params, clients_here=True, spec=SPEC)


def test_the_server_refuses_a_corrupt_file_before_round_1(good: dict[str, Path], tmp_path: Path) -> None:
    evalnet = inf_weights(good["evalnet"], tmp_path / "inf-evalnet.npz")
    out = tmp_path / "run"
    config = load_config(None, ["defense.name=refiner", f"defense.refiner.evalnet={evalnet}", f"out-dir={out}"])
    with pytest.raises(TrainedFileError) as caught:
        run_server(None, config)  # type: ignore[arg-type]  # refused before the grid is used
    assert f"{evalnet}: non-finite values in key 'net/features.0.weight'" in str(caught.value)
    assert not out.exists()


def test_the_attack_command_refuses_a_corrupt_file_before_any_attack_runs(
    good: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "run"
    (folder / OBSERVATIONS_DIR).mkdir(parents=True)
    generator = other_latent_dim(good["generator"], tmp_path / "other.npz")
    code = main(["attack", str(folder), "--set", "attack.name=ig,ggl", "--set", f"attack.ggl.generator={generator}"])
    assert code == 2
    err = capsys.readouterr().err
    assert f"attack.ggl.generator = {str(generator)!r}: {generator}: decoder arrays in the file do not match" in err
    assert "`fedguard train-generator --data <dataset> --out" in err
    assert not (folder / "attacks.jsonl").exists()
