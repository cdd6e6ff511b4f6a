"""A trained generator on disk: one ``.npz`` (no pickles).

Arrays ``decoder/<name>`` hold the decoder's ``state_dict``; ``meta`` is a JSON
string with the format version, latent dimension, network width, image spec
([C, H, W, classes]), the dataset and split it was trained on, the epochs and
the mean loss of each (nats per image).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedguard.data.spec import DataSpec
from fedguard.generators.model import Decoder

FORMAT = "fedguard-generator/1"


@dataclass(frozen=True)
class TrainedGenerator:
    """A decoder and what it was trained on: dataset, split and the loss of each epoch (nats per image)."""

    decoder: Decoder
    dataset: str
    split: str
    losses: tuple[float, ...]

    def meta(self) -> dict:
        """Every field but the weights, JSON-ready."""
        spec = self.decoder.spec
        return {
            "format": FORMAT,
            "latent_dim": self.decoder.latent_dim,
            "width": self.decoder.width,
            "spec": [spec.channels, spec.height, spec.width, spec.num_classes],
            "dataset": self.dataset,
            "split": self.split,
            "epochs": len(self.losses),
            "loss": self.losses[-1] if self.losses else None,
            "losses": list(self.losses),
        }


def default_generator_path(dataset: str) -> Path:
    """``generators/<dataset>.npz``, where ``fedguard train-generator`` writes by default."""
    return Path("generators") / f"{dataset}.npz"


def save_generator(trained: TrainedGenerator, path: Path) -> Path:
    """Write ``trained`` to ``path`` atomically (creating its folder); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {f"decoder/{name}": t.detach().cpu().numpy() for name, t in trained.decoder.state_dict().items()}
    partial = path.with_name(f".{path.name}.part")
    with open(partial, "wb") as handle:
        np.savez(handle, meta=np.array(json.dumps(trained.meta())), **arrays)
    os.replace(partial, path)
    return path


def load_generator(path: Path | str) -> TrainedGenerator:
    """Read a generator written by ``save_generator``; the decoder is in eval mode, frozen, on the CPU.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for another format or mismatched arrays."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no generator at {path}; create it with `fedguard train-generator --data <dataset> --out {path}`"
        )
    with np.load(path, allow_pickle=False) as archive:
        if "meta" not in archive.files:
            raise ValueError(f"{path} is not a generator file: it has no 'meta' entry")
        meta = json.loads(str(archive["meta"]))
        arrays = {name.removeprefix("decoder/"): archive[name] for name in archive.files if name.startswith("decoder/")}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: generator format {meta.get('format')!r}, expected {FORMAT!r}; retrain it")
    decoder = Decoder(DataSpec(*meta["spec"]), meta["latent_dim"], meta["width"])
    expected = {name: tuple(t.shape) for name, t in decoder.state_dict().items()}
    found = {name: tuple(a.shape) for name, a in arrays.items()}
    if found != expected:
        raise ValueError(f"{path}: decoder arrays {found} do not match its meta, which needs {expected}")
    decoder.load_state_dict({name: torch.from_numpy(a) for name, a in arrays.items()})
    return TrainedGenerator(decoder.eval().requires_grad_(False), meta["dataset"], meta["split"], tuple(meta["losses"]))
