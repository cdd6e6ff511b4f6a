"""A trained evaluation network on disk: one ``.npz`` (no pickles).

Arrays ``net/<name>`` hold the network's ``state_dict``; ``meta`` is a JSON
string with the format version, channel width, image spec ([C, H, W, classes]),
the dataset and split it was trained on, the epochs and the mean squared error
of the predicted noise ratio in each.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedguard.archive import load_module_arrays, module_arrays, save_archive
from fedguard.data.spec import DataSpec
from fedguard.evalnet.model import EvalNet

FORMAT = "fedguard-evalnet/1"
COMMAND = "fedguard train-evalnet --data <dataset>"


@dataclass(frozen=True)
class TrainedEvalNet:
    """A network and what it was trained on: dataset, split and each epoch's mean squared error of the ratio."""

    net: EvalNet
    dataset: str
    split: str
    losses: tuple[float, ...]

    def meta(self) -> dict:
        """Every field but the weights, JSON-ready."""
        spec = self.net.spec
        return {
            "format": FORMAT,
            "width": self.net.width,
            "spec": [spec.channels, spec.height, spec.width, spec.num_classes],
            "dataset": self.dataset,
            "split": self.split,
            "epochs": len(self.losses),
            "loss": self.losses[-1] if self.losses else None,
            "losses": list(self.losses),
        }

    def check_shape(self, shape: tuple[int, ...], path: Path | str) -> None:
        """Raises ``ValueError`` unless the network (read from ``path``) takes images of ``shape`` (C, H, W)."""
        if tuple(shape) != self.net.spec.shape:
            raise ValueError(
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


def load_evalnet(path: Path | str) -> TrainedEvalNet:
    """Read a network written by ``save_evalnet``; it is in eval mode, frozen, on the CPU.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for another format or mismatched arrays."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no evaluation network at {path}; create it with `{COMMAND} --out {path}`")
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as error:
        raise ValueError(f"{path} is not an evaluation-network file: {error}") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ValueError(f"{path} is not an evaluation-network file: it holds one array, not an .npz archive")
    with archive:
        if "meta" not in archive.files:
            raise ValueError(f"{path} is not an evaluation-network file: it has no 'meta' entry")
        meta = json.loads(str(archive["meta"]))
        arrays = {name.removeprefix("net/"): archive[name] for name in archive.files if name.startswith("net/")}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: evaluation-network format {meta.get('format')!r}, expected {FORMAT!r}; retrain it")
    net = load_module_arrays(EvalNet(DataSpec(*meta["spec"]), meta["width"]), arrays, path, "network")
    return TrainedEvalNet(net.eval().requires_grad_(False), meta["dataset"], meta["split"], tuple(meta["losses"]))
