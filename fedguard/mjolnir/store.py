"""A trained gradient diffusion model on disk: one ``.npz`` (no pickles).

Arrays ``unet/<name>`` hold the denoiser's ``state_dict``; ``meta`` is a JSON
string with the format version, the UNet configuration, the grid side S, the
beta schedule, the caller's normalization record (e.g. the scale that maps raw
gradients to training units and the clean signal power in those units) and the
mean loss of each epoch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedguard.archive import load_module_arrays, module_arrays, save_archive
from fedguard.mjolnir.ddpm import Schedule
from fedguard.mjolnir.unet import UNet, UNetConfig

FORMAT = "fedguard-mjolnir-ddpm/1"


@dataclass(frozen=True)
class TrainedDDPM:
    """A denoiser, its schedule, the caller's normalization record (JSON-ready) and each epoch's mean loss."""

    model: UNet
    schedule: Schedule
    normalization: dict = field(default_factory=dict)
    losses: tuple[float, ...] = ()

    def meta(self) -> dict:
        """Every field but the weights, JSON-ready."""
        return {
            "format": FORMAT,
            "unet": self.model.config.to_dict(),
            "side": self.model.side,
            "schedule": self.schedule.to_dict(),
            "normalization": self.normalization,
            "epochs": len(self.losses),
            "losses": list(self.losses),
        }


def save_ddpm(trained: TrainedDDPM, path: Path | str) -> Path:
    """Write ``trained`` to ``path`` atomically (creating its folder); returns the path."""
    return save_archive(path, trained.meta(), module_arrays(trained.model, "unet"))


def load_ddpm(path: Path | str) -> TrainedDDPM:
    """Read a model written by ``save_ddpm``; the denoiser is in eval mode, frozen, on the CPU.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for another format or mismatched arrays."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no Mjölnir diffusion model at {path}; create it with `fedguard train-mjolnir`")
    with np.load(path, allow_pickle=False) as archive:
        if "meta" not in archive.files:
            raise ValueError(f"{path} is not a Mjölnir diffusion model file: it has no 'meta' entry")
        meta = json.loads(str(archive["meta"]))
        arrays = {name.removeprefix("unet/"): archive[name] for name in archive.files if name.startswith("unet/")}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}; retrain it")
    model = load_module_arrays(UNet(UNetConfig(**meta["unet"]), meta["side"]), arrays, path, "UNet")
    return TrainedDDPM(
        model.eval().requires_grad_(False), Schedule(**meta["schedule"]), meta["normalization"], tuple(meta["losses"])
    )
