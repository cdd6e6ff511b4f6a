"""A trained gradient diffusion model on disk: one ``.npz`` (no pickles).

Arrays ``unet/<name>`` hold the denoiser's ``state_dict``; ``meta`` is a JSON
string with the format version, the UNet configuration, the grid side S, the
beta schedule, the caller's normalization record (e.g. the scale that maps raw
gradients to training units and the clean signal power in those units), the
mean loss of each epoch, and the model's kind: ``conditional`` (absent in files
of unconditional models written before the conditional variant existed) with
the ``noise_range`` (M_min, M_max) of its training conditions, null for an
unconditional model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from attackers.diffusion.condition import check_noise_range
from attackers.diffusion.ddpm import Schedule
from attackers.diffusion.packing import spec_from_dict
from attackers.diffusion.unet import UNet, UNetConfig
from fedguard.registry import TrainedFileError
from fedguard.trained.archive import load_module_arrays, module_arrays, save_archive
from fedguard.trained.files import FileKind, described, read_archive

FORMAT = "fedguard-mjolnir-ddpm/1"


@dataclass(frozen=True)
class TrainedDDPM:
    """A denoiser, its schedule, the caller's normalization record (JSON-ready), each epoch's mean loss and, for a
    conditional denoiser, the ``noise_range`` (M_min, M_max) it was trained on (None for an unconditional one)."""

    model: UNet
    schedule: Schedule
    normalization: dict[str, Any] = field(default_factory=dict)
    losses: tuple[float, ...] = ()
    noise_range: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.model.conditional != (self.noise_range is not None):
            raise ValueError(
                f"the denoiser is {kind(self.model.conditional)}: noise_range must be "
                f"{'(M_min, M_max)' if self.model.conditional else 'None'}, got {self.noise_range!r}"
            )
        if self.noise_range is not None:
            object.__setattr__(self, "noise_range", check_noise_range(self.noise_range))

    @property
    def conditional(self) -> bool:
        """Whether the denoiser takes a condition (the noisy upload) beside x_t."""
        return self.model.conditional

    def meta(self) -> dict[str, Any]:
        """Every field but the weights, JSON-ready."""
        return {
            "format": FORMAT,
            "unet": self.model.config.to_dict(),
            "side": self.model.side,
            "schedule": self.schedule.to_dict(),
            "normalization": self.normalization,
            "epochs": len(self.losses),
            "losses": list(self.losses),
            "conditional": self.conditional,
            "noise_range": None if self.noise_range is None else list(self.noise_range),
        }


def kind(conditional: bool) -> str:
    """'conditional' or 'unconditional'."""
    return "conditional" if conditional else "unconditional"


def save_ddpm(trained: TrainedDDPM, path: Path | str) -> Path:
    """Write ``trained`` to ``path`` atomically (creating its folder); returns the path."""
    return save_archive(path, trained.meta(), module_arrays(trained.model, "unet"))


def missing_ddpm(path: Path | str) -> str:
    """Why no Mjölnir diffusion model loads from ``path``, and how to make one."""
    return f"no Mjölnir diffusion model at {path}; create it with `fedguard train-mjolnir`"


def ddpm_command(path: Path) -> str:
    """The command that writes a Mjölnir diffusion model at ``path``."""
    return (
        f"`fedguard train-mjolnir` on the preset of the run it attacks: `fedguard train-mjolnir <preset> --out {path}`"
    )


def beside_model_command(path: Path, suffix: str) -> str:
    """The command that writes a model ``<name>.npz`` and, beside it, the file ``<name><suffix>`` at ``path``."""
    name = path.name.removesuffix(suffix) if path.name.endswith(suffix) else "<name>"
    return (
        f"`fedguard train-mjolnir <preset> --out {path.with_name(name + '.npz')}`, which writes "
        f"{path.with_name(name + suffix)} beside the model"
    )


DDPM_FILE = FileKind("Mjölnir diffusion model", "a Mjölnir diffusion model file", FORMAT, ("meta",), ddpm_command)


def load_ddpm(path: Path | str, conditional: bool | None = None) -> TrainedDDPM:
    """Read a model written by ``save_ddpm``; the denoiser is in eval mode, frozen, on the CPU. ``conditional``:
    the kind expected (None: whichever the file holds).

    Raises ``TrainedFileError`` (``MissingTrainedFile`` for a missing file) for a file that is not a diffusion
    model, holds arrays its meta does not describe, non-finite weights, a packing for another grid side, or
    another kind than expected."""
    path = Path(path)
    meta, arrays = read_archive(path, DDPM_FILE)
    held = meta.get("conditional", False)
    if not isinstance(held, bool):
        raise DDPM_FILE.error(path, f"its meta's 'conditional' is {held!r}, expected true or false")
    if conditional is not None and conditional != held:
        raise TrainedFileError(
            f"{path}: its Mjölnir denoiser is {kind(held)}, expected {kind(conditional)}; train "
            f"one with `fedguard train-mjolnir{' --conditional' if conditional else ''}`"
        )
    return described(lambda: ddpm_of(meta, arrays, path, held), path, DDPM_FILE)


def ddpm_of(meta: dict[str, Any], arrays: dict[str, np.ndarray], path: Path, conditional: bool) -> TrainedDDPM:
    """The model ``meta`` describes, with the weights ``arrays`` (checked) of the file at ``path``."""
    model = UNet(UNetConfig(**meta["unet"]), meta["side"], conditional)
    load_module_arrays(model, arrays, "unet", path, DDPM_FILE, "UNet")
    normalization = meta["normalization"]
    packing = normalization.get("packing")
    packed_side = None if packing is None else spec_from_dict(packing).side
    if packed_side not in (None, model.side):
        raise DDPM_FILE.error(
            path, f"its gradient packing makes grids of side {packed_side}, its UNet takes side {model.side}"
        )
    noise_range = meta.get("noise_range")
    return TrainedDDPM(
        model.eval().requires_grad_(False),
        Schedule(**meta["schedule"]),
        normalization,
        tuple(meta["losses"]),
        None if noise_range is None else tuple(noise_range),
    )
