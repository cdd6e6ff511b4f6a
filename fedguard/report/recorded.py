"""A finished run's configuration as its ``config.toml`` records it, read without importing the run's plugins and
without validating it again: the run was checked when it started, and a reader of its folder (``fedguard report``)
may sit where the plugins it used cannot be imported."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedguard.config import ConfigError, flatten, read_toml
from fedguard.store.folder import CONFIG_FILE


@dataclass(frozen=True)
class RecordedConfig:
    """The flat keys of a run's ``config.toml`` (``train.rounds`` -> 100), as written when the run started."""

    keys: dict[str, Any]

    def value(self, key: str, default: Any = None) -> Any:
        """The recorded value of ``key``, else ``default``."""
        return self.keys.get(key, default)

    def names(self, kind: str) -> list[str]:
        """The chosen components of ``kind`` (``defense``, ``attack``, ...) from ``<kind>.name``, in order."""
        return [name.strip() for name in str(self.keys.get(f"{kind}.name", "")).split(",") if name.strip()]

    def params(self, prefix: str) -> dict[str, Any]:
        """The parameters recorded under ``prefix`` (``defense.dp``): ``{"clip": 1.0, ...}``, in file order."""
        start = f"{prefix}."
        return {key[len(start) :]: value for key, value in self.keys.items() if key.startswith(start)}

    def described(self, prefix: str, name: str) -> str:
        """``name (key=value, ...)`` with the parameters under ``prefix``, or ``name`` when there are none."""
        params = self.params(prefix)
        return f"{name} ({', '.join(f'{k}={v}' for k, v in params.items())})" if params else name


def read_recorded_config(run_dir: Path) -> RecordedConfig:
    """The configuration ``run_dir/config.toml`` records; raises ``ConfigError`` when it is missing or is not
    TOML."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise ConfigError([f"{CONFIG_FILE} is missing"])
    try:
        return RecordedConfig(flatten(read_toml(path)))
    except ConfigError as error:
        raise ConfigError([f"{CONFIG_FILE} could not be read: {'; '.join(error.problems)}"]) from None
