"""A trained generator on disk: one ``.npz`` (no pickles).

Arrays ``decoder/<name>`` hold the decoder's ``state_dict``; ``meta`` is a JSON
string with the format version, latent dimension, network width, image spec
([C, H, W, classes]), the dataset and split it was trained on, the epochs and
the mean loss of each (nats per image).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attackers.generators.model import Decoder
from fedguard.data.spec import DataSpec
from fedguard.trained.archive import load_module_arrays, module_arrays, save_archive
from fedguard.trained.files import FileKind, load_trained
from fedguard.trained.fitting import trained_meta

FORMAT = "fedguard-generator/1"


@dataclass(frozen=True)
class TrainedGenerator:
    """A decoder and what it was trained on: dataset, split and the loss of each epoch (nats per image)."""

    decoder: Decoder
    dataset: str
    split: str
    losses: tuple[float, ...]

    def meta(self) -> dict[str, Any]:
        """Every field but the weights, JSON-ready."""
        return {
            **trained_meta(FORMAT, self.decoder.spec, self.dataset, self.split, self.losses),
            "latent_dim": self.decoder.latent_dim,
            "width": self.decoder.width,
        }


def default_generator_path(dataset: str) -> Path:
    """``generators/<dataset>.npz``, where ``fedguard train-generator`` writes by default."""
    return Path("generators") / f"{dataset}.npz"


def save_generator(trained: TrainedGenerator, path: Path) -> Path:
    """Write ``trained`` to ``path`` atomically (creating its folder); returns the path."""
    return save_archive(path, trained.meta(), module_arrays(trained.decoder, "decoder"))


def generator_command(path: Path) -> str:
    """The command that writes a generator at ``path``."""
    return f"`fedguard train-generator --data <dataset> --out {path}`"


GENERATOR_FILE = FileKind("generator", "a generator file", FORMAT, ("meta",), generator_command)


def missing_generator(path: Path | str) -> str:
    """Why no generator loads from ``path``, and how to make one."""
    return str(GENERATOR_FILE.missing(Path(path)))


def load_generator(path: Path | str) -> TrainedGenerator:
    """Read a generator written by ``save_generator``; the decoder is in eval mode, frozen, on the CPU.

    Raises ``TrainedFileError`` (``MissingTrainedFile`` for a missing file) for a file that is not a generator,
    holds arrays its meta does not describe, or non-finite weights."""
    return load_trained(path, GENERATOR_FILE, generator_of)


def generator_of(meta: dict[str, Any], arrays: dict[str, np.ndarray], path: Path) -> TrainedGenerator:
    """The generator ``meta`` describes, with the decoder weights ``arrays`` (checked) of the file at ``path``."""
    decoder = Decoder(DataSpec(*meta["spec"]), meta["latent_dim"], meta["width"])
    load_module_arrays(decoder, arrays, "decoder", path, GENERATOR_FILE, "decoder")
    return TrainedGenerator(decoder.eval().requires_grad_(False), meta["dataset"], meta["split"], tuple(meta["losses"]))
