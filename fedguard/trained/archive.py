"""Trained artifacts as one ``.npz`` each: named arrays plus a JSON ``meta`` string, no pickles.

Generators, evaluation networks, diffusion models, checkpoints and gradient sets share this file layout;
each module keeps its own ``meta``; ``fedguard.trained.files`` checks what they read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn as nn

from fedguard.atomic import replacing
from fedguard.trained.files import FileKind, check_arrays

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def save_archive(
    path: Path | str, meta: dict[str, Any], arrays: dict[str, np.ndarray], compressed: bool = False
) -> Path:
    """Write ``arrays`` and ``meta`` (as JSON) to ``path`` atomically, creating its folder; returns the path."""
    path = Path(path)
    write = np.savez_compressed if compressed else np.savez
    with replacing(path) as handle:
        # mypy takes **arrays for a value of the keyword-only allow_pickle (a bool)
        write(handle, meta=np.array(json.dumps(meta)), **arrays)  # type: ignore[arg-type]
    return path


def module_arrays(module: nn.Module, prefix: str) -> dict[str, np.ndarray]:
    """``module``'s ``state_dict`` as numpy arrays named ``<prefix>/<entry>``."""
    return {f"{prefix}/{name}": t.detach().cpu().numpy() for name, t in module.state_dict().items()}


def module_layout(module: nn.Module, prefix: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Name (``<prefix>/<entry>``), shape and dtype of each ``state_dict`` entry of ``module``, as ``module_arrays``
    writes them."""
    entries = module.state_dict().items()
    return {f"{prefix}/{name}": (tuple(t.shape), t.detach().cpu().numpy().dtype) for name, t in entries}


def load_module_arrays(
    module: ModuleT, arrays: dict[str, np.ndarray], prefix: str, path: Path, kind: FileKind, label: str
) -> ModuleT:
    """Load ``arrays`` (named ``<prefix>/<entry>``: every array of the file at ``path`` but its meta) into
    ``module``, built from the file's meta, after ``check_arrays`` against its ``state_dict`` (``label`` names
    them in its errors). Returns ``module``."""
    layout = module_layout(module, prefix)
    check_arrays(arrays, layout, path, kind, label)
    module.load_state_dict(
        {
            name.removeprefix(f"{prefix}/"): torch.from_numpy(array.astype(layout[name][1], copy=False))
            for name, array in arrays.items()
        }
    )
    return module
