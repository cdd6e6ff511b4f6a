"""A trained evaluation network on disk: one ``.npz`` (no pickles).

Arrays ``net/<name>`` hold the network's ``state_dict``; ``meta`` is a JSON
string with the format version, channel width, image spec ([C, H, W, classes]),
the dataset and split it was trained on, the epochs and the mean squared error
of the predicted noise ratio in each.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedguard.data.spec import DataSpec
from fedguard.defenses.evalnet.model import EvalNet
from fedguard.registry import TrainedFileError
from fedguard.trained.archive import load_module_arrays, module_arrays, save_archive
from fedguard.trained.files import FileKind, load_trained
from fedguard.trained.fitting import trained_meta

FORMAT = "fedguard-evalnet/1"
COMMAND = "fedguard train-evalnet --data <dataset>"


@dataclass(frozen=True)
class TrainedEvalNet:
    """A network and what it was trained on: dataset, split and each epoch's mean squared error of the ratio."""

    net: EvalNet
    dataset: str
    split: str
    losses: tuple[float, ...]

    def meta(self) -> dict[str, Any]:
        """Every field but the weights, JSON-ready."""
        return {**trained_meta(FORMAT, self.net.spec, self.dataset, self.split, self.losses), "width": self.net.width}

    def check_shape(self, shape: tuple[int, ...], path: Path | str) -> None:
        """Raises ``TrainedFileError`` unless the network (read from ``path``) takes images of ``shape`` (C, H, W)."""
        if tuple(shape) != self.net.spec.shape:
            raise TrainedFileError(
                f"the evaluation network {path} was trained on images of shape {self.net.spec.shape} "
                f"({self.dataset}), but these images have shape {tuple(shape)}; train one on similar data with "
                f"`{COMMAND}`"
            )


def default_evalnet_path(dataset: str) -> Path:
    """``evalnets/<dataset>.npz``, where ``fedguard train-evalnet`` writes by default."""
    return Path("evalnets") / f"{dataset}.npz"


def save_evalnet(trained: TrainedEvalNet, path: Path | str) -> Path:
    """Write ``trained`` to ``path`` atomically (creating its folder); returns the path."""
    return save_archive(path, trained.meta(), module_arrays(trained.net, "net"))


def evalnet_command(path: Path) -> str:
    """The command that writes an evaluation network at ``path``."""
    return f"`{COMMAND} --out {path}`"


EVALNET_FILE = FileKind("evaluation network", "an evaluation-network file", FORMAT, ("meta",), evalnet_command)


def load_evalnet(path: Path | str) -> TrainedEvalNet:
    """Read a network written by ``save_evalnet``; it is in eval mode, frozen, on the CPU.

    Raises ``TrainedFileError`` (``MissingTrainedFile`` for a missing file) for a file that is not an evaluation
    network, holds arrays its meta does not describe, or non-finite weights."""
    return load_trained(path, EVALNET_FILE, evalnet_of)


def evalnet_of(meta: dict[str, Any], arrays: dict[str, np.ndarray], path: Path) -> TrainedEvalNet:
    """The network ``meta`` describes, with the weights ``arrays`` (checked) of the file at ``path``."""
    net = load_module_arrays(
        EvalNet(DataSpec(*meta["spec"]), meta["width"]), arrays, "net", path, EVALNET_FILE, "network"
    )
    return TrainedEvalNet(net.eval().requires_grad_(False), meta["dataset"], meta["split"], tuple(meta["losses"]))
