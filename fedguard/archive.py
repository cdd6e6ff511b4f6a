"""Trained artifacts as one ``.npz`` each: named arrays plus a JSON ``meta`` string, no pickles.

Generators, evaluation networks, diffusion models and gradient sets share this file layout; each module
keeps its own ``meta`` and its own checks of what it reads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn


def save_archive(path: Path | str, meta: dict[str, Any], arrays: dict[str, np.ndarray], compressed: bool = False) -> Path:
    """Write ``arrays`` and ``meta`` (as JSON) to ``path`` atomically, creating its folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.part")
    write = np.savez_compressed if compressed else np.savez
    with open(partial, "wb") as handle:
        write(handle, meta=np.array(json.dumps(meta)), **arrays)
    os.replace(partial, path)
    return path


def module_arrays(module: nn.Module, prefix: str) -> dict[str, np.ndarray]:
    """``module``'s ``state_dict`` as numpy arrays named ``<prefix>/<entry>``."""
    return {f"{prefix}/{name}": t.detach().cpu().numpy() for name, t in module.state_dict().items()}


def load_module_arrays(module: nn.Module, arrays: dict[str, np.ndarray], path: Path, what: str) -> nn.Module:
    """Load ``arrays`` (entry name -> array) into ``module``; ``ValueError`` naming ``path`` when their shapes
    differ from the ones ``module``, built from the file's meta, needs. Returns ``module``."""
    expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    found = {name: tuple(a.shape) for name, a in arrays.items()}
    if found != expected:
        raise ValueError(f"{path}: {what} arrays {found} do not match its meta, which needs {expected}")
    module.load_state_dict({name: torch.from_numpy(a) for name, a in arrays.items()})
    return module
