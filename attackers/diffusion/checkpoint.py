"""A gradient DDPM's training cut after an epoch, on disk, to go on with later: one ``.npz`` (no pickles).

Arrays ``weights/<name>`` and ``best/<name>`` hold the denoiser's ``state_dict`` now and at its lowest-loss
epoch, ``adam/<index>/<key>`` Adam's state of the parameter at ``index`` (step, exp_avg, exp_avg_sq) and
``rng`` the state of the generator of batches, steps and noise (uint8). ``meta`` is a JSON string with the
format version, the epochs done and their mean losses, the UNet configuration and grid side S, the training
options, the normalization record of the training gradients (packing, model, data, surrogate) and the SHA-256
of the training grids. A run resumes only on the same grids, with the same record, configuration and options
(``epochs`` aside).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attackers.diffusion.ddpm import DDPMTrainOptions, Schedule, TrainState
from attackers.diffusion.store import beside_model_command
from attackers.diffusion.unet import UNet, UNetConfig
from fedguard.trained.archive import module_layout, save_archive
from fedguard.trained.files import FileKind, check_arrays, load_trained

FORMAT = "fedguard-mjolnir-checkpoint/1"


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """The ``state`` of a run on grids of side ``side`` with SHA-256 ``digest``, for a UNet of ``config``
    trained with ``options`` (their ``epochs``: the run's target then), and the grids' normalization
    ``record`` (JSON-ready)."""

    state: TrainState
    config: UNetConfig
    side: int
    options: DDPMTrainOptions
    record: dict[str, Any]
    digest: str

    def meta(self) -> dict[str, Any]:
        """Every field but the tensors, JSON-ready."""
        return {
            "format": FORMAT,
            "epoch": self.state.epoch,
            "losses": list(self.state.losses),
            "unet": self.config.to_dict(),
            "side": self.side,
            "options": options_to_dict(self.options),
            "record": self.record,
            "digest": self.digest,
        }


def options_to_dict(options: DDPMTrainOptions) -> dict[str, Any]:
    """``options`` as JSON-ready values, the schedule as its fields."""
    return {**asdict(options), "schedule": options.schedule.to_dict()}


def options_from_dict(values: dict[str, Any]) -> DDPMTrainOptions:
    """The options ``options_to_dict`` wrote."""
    return DDPMTrainOptions(**{**values, "schedule": Schedule(**values["schedule"])})


def grids_digest(images: torch.Tensor) -> str:
    """SHA-256 (hex) of the training grids (N, 1, S, S): their shape, dtype and every value."""
    array = np.ascontiguousarray(images.detach().cpu().numpy())
    digest = hashlib.sha256(f"{array.shape}{array.dtype}".encode())
    digest.update(array.tobytes())
    return digest.hexdigest()


def _state_arrays(state: TrainState) -> dict[str, np.ndarray]:
    arrays = {f"weights/{name}": t.numpy() for name, t in state.weights.items()}
    arrays.update({f"best/{name}": t.numpy() for name, t in state.best.items()})
    for index, entries in state.optimizer.items():
        arrays.update({f"adam/{index}/{key}": t.numpy() for key, t in entries.items()})
    arrays["rng"] = state.rng.numpy()
    return arrays


def save_checkpoint(checkpoint: Checkpoint, path: Path | str) -> Path:
    """Write ``checkpoint`` to ``path`` atomically (creating its folder); returns the path."""
    return save_archive(path, checkpoint.meta(), _state_arrays(checkpoint.state))


def checkpoint_command(path: Path) -> str:
    """The command that writes a training checkpoint at ``path``."""
    return beside_model_command(path, ".checkpoint.npz")


CHECKPOINT_FILE = FileKind(
    "Mjölnir training checkpoint", "a Mjölnir training checkpoint", FORMAT, ("meta", "rng"), checkpoint_command
)


def load_checkpoint(path: Path | str) -> Checkpoint:
    """Read a checkpoint written by ``save_checkpoint``, its tensors on the CPU.

    Raises ``TrainedFileError`` (``MissingTrainedFile`` for a missing file) for a file that is not a checkpoint,
    holds arrays its meta does not describe, or non-finite values."""
    return load_trained(path, CHECKPOINT_FILE, checkpoint_of)


def checkpoint_of(meta: dict[str, Any], arrays: dict[str, np.ndarray], path: Path) -> Checkpoint:
    """The checkpoint ``meta`` describes, with the training state ``arrays`` (checked) of the file at ``path``."""
    config, options = UNetConfig(**meta["unet"]), options_from_dict(meta["options"])
    model = UNet(config, meta["side"], options.noise_range is not None)
    check_arrays(arrays, state_layout(model, arrays), path, CHECKPOINT_FILE, "training state")
    tensors = {name: torch.from_numpy(array) for name, array in arrays.items()}
    optimizer: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if name.startswith("adam/"):
            _, index, key = name.split("/")
            optimizer.setdefault(int(index), {})[key] = tensor
    state = TrainState(
        meta["epoch"],
        {name.removeprefix("weights/"): t for name, t in tensors.items() if name.startswith("weights/")},
        {name.removeprefix("best/"): t for name, t in tensors.items() if name.startswith("best/")},
        dict(sorted(optimizer.items())),
        tensors["rng"],
        tuple(meta["losses"]),
    )
    return Checkpoint(state, config, meta["side"], options, meta["record"], meta["digest"])


def state_layout(model: UNet, names: Iterable[str]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """What a checkpoint of ``model`` holds: its weights now and at the best epoch, Adam's state of each parameter
    whose index ``names`` use (the step and two moments of the parameter's shape) and the generator state (uint8,
    any length)."""
    layout = {**module_layout(model, "weights"), **module_layout(model, "best"), "rng": ((-1,), np.dtype(np.uint8))}
    shapes = [tuple(p.shape) for p in model.parameters()]
    for index in adam_indices(names, len(shapes)):
        layout[f"adam/{index}/step"] = ((), np.dtype(np.float32))
        for key in ("exp_avg", "exp_avg_sq"):
            layout[f"adam/{index}/{key}"] = (shapes[index], np.dtype(np.float32))
    return layout


def adam_indices(names: Iterable[str], count: int) -> set[int]:
    """The parameter indices below ``count`` that array names ``adam/<index>/<key>`` hold Adam state for."""
    parts = [name.split("/") for name in names if name.startswith("adam/")]
    return {int(p[1]) for p in parts if len(p) == 3 and p[1].isdigit() and int(p[1]) < count}


def check_resumable(
    checkpoint: Checkpoint,
    config: UNetConfig,
    side: int,
    options: DDPMTrainOptions,
    record: dict[str, Any],
    digest: str,
) -> None:
    """``ValueError`` listing every difference between ``checkpoint``'s run and the one about to resume it (grids,
    record, UNet, options other than ``epochs``, or fewer ``epochs`` than it has trained)."""
    problems = []
    record = json.loads(json.dumps(record))
    for key in sorted(set(checkpoint.record) | set(record)):
        if checkpoint.record.get(key) != record.get(key):
            problems.append(f"training gradients' {key}: {checkpoint.record.get(key)!r} then, {record.get(key)!r} now")
    if not problems and checkpoint.digest != digest:
        problems.append("the training gradients differ from those it trained on (same record, other values)")
    if (checkpoint.config, checkpoint.side) != (config, side):
        problems.append(f"UNet {checkpoint.config} on side {checkpoint.side} then, {config} on side {side} now")
    then, now = options_to_dict(checkpoint.options), options_to_dict(options)
    problems += [
        f"DDPM {name}: {then[name]!r} then, {now[name]!r} now"
        for name in then
        if name != "epochs" and then[name] != now[name]
    ]
    if options.epochs < checkpoint.state.epoch:
        problems.append(f"it has trained {checkpoint.state.epoch} epochs, more than epochs={options.epochs}")
    if problems:
        raise ValueError("cannot resume this checkpoint: " + "; ".join(problems))
