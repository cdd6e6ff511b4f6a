"""Where a run's folder goes and its ``config.toml`` (file names and writers: ``fedguard.store.folder``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomli_w

from fedguard.config import Config
from fedguard.store.folder import CONFIG_FILE, OBSERVATIONS_DIR, ROUNDS_FILE, write_atomic

__all__ = [
    "CONFIG_FILE",
    "OBSERVATIONS_DIR",
    "ROUNDS_FILE",
    "free_run_dir",
    "prepare_run_dir",
    "resolve_run_dir",
    "unflatten",
]


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys -> nested tables (the inverse of ``fedguard.config.flatten``)."""
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        *tables, leaf = key.split(".")
        node = nested
        for table in tables:
            node = node.setdefault(table, {})
        node[leaf] = value
    return nested


def config_toml(config: Config) -> str:
    """``config`` as the TOML of a preset (every key, nested tables), as ``config.toml`` holds it."""
    return tomli_w.dumps(unflatten(config.to_flat()))


def resolve_run_dir(config: Config) -> Path:
    """The folder a run writes to, absolute; never one that already holds a round log.

    An explicit ``out-dir`` that holds a run is an error; the default
    ``runs/<name>`` moves on to ``runs/<name>-2``, ``-3``, ... instead.
    """
    folder = config.run_dir().resolve()
    if config.run.out_dir and (folder / ROUNDS_FILE).exists():
        raise FileExistsError(f"out-dir {folder} already holds a run ({ROUNDS_FILE}); choose another or remove it")
    return free_run_dir(folder)


def free_run_dir(folder: Path) -> Path:
    """``folder``, or ``folder-2``, ``-3``, ... the first that holds no round log."""
    if not (folder / ROUNDS_FILE).exists():
        return folder
    number = 2
    while (folder.with_name(f"{folder.name}-{number}") / ROUNDS_FILE).exists():
        number += 1
    return folder.with_name(f"{folder.name}-{number}")


def prepare_run_dir(config: Config) -> Path:
    """Create the run folder of ``config`` (``out-dir`` must be set) and write the resolved config.

    ``config.toml`` reproduces the run when passed back as a preset.
    """
    folder = config.run_dir()
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / CONFIG_FILE, config_toml(config))
    return folder
